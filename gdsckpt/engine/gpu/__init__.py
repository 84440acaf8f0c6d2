"""The GPU backend. Only modules in this package import cupy, kvikio and nvidia.nvcomp."""
