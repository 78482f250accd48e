"""What the generator and the runtime share, written once: the manifest reader (manifest_reader.py:
checks generated/ against manifest.json and builds the source NVRTC compiles) and the CUDA pieces
NVRTC compiles with (cuda_env.py). Standard library only at import; it imports neither the
generator nor the runtime, which may both import it (they never import each other)."""
