"""omni-cache-toy: a cache backend that reuses each request's denoiser output on every other step."""
