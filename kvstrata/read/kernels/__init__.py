"""Decode-attention kernels over encoded KV: a C++ CPU kernel (built on first use) and Triton GPU kernels."""
