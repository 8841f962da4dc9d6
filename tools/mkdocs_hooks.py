"""mkdocs hook (mkdocs.yml ``hooks:``): the docstrings use Sphinx roles (``:func:`attention```), which
mkdocstrings leaves as text, so the API reference showed ":func:" before each name. Each role around a
code span becomes the plain code span. The Markdown pages themselves use no roles."""

import re

_ROLE = re.compile(r":(?:py:)?(?:func|class|mod|meth|attr|exc|data|obj|const|type):(?=<code>)")


def on_page_content(html, **kwargs):
    return _ROLE.sub("", html)
