"""The unfused chains the world-size-1 benchmark (moe_ar_tools/bench_one/) measures ours against:
the torch chain (torch_chain.py: eager and under torch.compile) and FlashInfer's norm kernels after a
compiled torch finalize (flashinfer_norm.py; fetch_flashinfer.sh prepares their sources)."""
