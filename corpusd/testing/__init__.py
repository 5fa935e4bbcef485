"""What corpusd's tests and tools share, shipped in the package as DeepGEMM ships its test
helpers: the comparison (``numeric``), corpora and holder processes (``holders``), the
transformers oracle and the decode it is compared with (``oracle``), checkpoints written by
transformers (``hf_checkpoints``) and a drawn config run end to end (``config_runs``), the gRPC
fuzzer (``fuzzing``, ``fuzz_requests``, ``fuzz_mutate``), a random GPU resident for the SGLang
device path (``resident``) and a TCP proxy that delays, partitions or resets a link between
daemons (``tcp_proxy``).

Not imported by corpusd itself: these modules start daemons, so they sit at the top of the
layering beside ``corpusd.cli`` (``tests/unit/test_layering.py``). transformers is a test extra;
the modules that need it import it inside the functions that call it.
"""
