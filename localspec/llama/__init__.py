"""llama.cpp access: a loaded model (model), its vocabulary (vocab), its logits rows (logits), a
model loaded on first use (lazy) and what its KV cache holds (sequence), the process-wide set-up
(backend), ggml's device API (ggml), CPU kernel choice (kernels, buffer_types) and its checks
(kernel_verdicts, kernel_check, on tiny_model), this machine (host), RPC servers (rpc), and the
registry of known GGUF models (registry)."""
