"""asv benchmarks for cuflash (run from asv_bench/, see asv.conf.json)."""
