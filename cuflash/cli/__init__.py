"""The command-line tools: ``python -m cuflash`` (:mod:`.main`: demo, bench, tune), the GPU, CPU and decode
benchmarks (:mod:`.bench_gpu`, :mod:`.bench_cpu`, :mod:`.bench_decode`) and their plots (:mod:`.plots`)."""
