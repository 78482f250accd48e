"""The unfused chains the benchmark at world size 1 (moe_ar_tools/bench/world_one/) measures ours against:
the torch chain (torch_chain.py: eager and under torch.compile) and FlashInfer's norm kernels after a
compiled torch finalize (flashinfer_norm.py; fetch_flashinfer.sh prepares their sources)."""
