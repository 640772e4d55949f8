"""Engine adapters: the engine-neutral kit (:mod:`.kit`) and one package per engine (:mod:`.vllm`).
May import every room but the command line."""
