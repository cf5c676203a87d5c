"""llama.cpp access: a loaded model (model) and what its KV cache holds (sequence), the
process-wide set-up (backend), ggml's device API (ggml), CPU kernel choice and its check
(kernels, kernel_check), RPC servers (rpc), and the registry of known GGUF models (registry)."""
