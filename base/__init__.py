"""What every layer may import and which imports no other part of hipc: errors, versions,
the file formats both the compiler and the runtime read (safetensors, tokenizer and its
chat template) and the CPU feature flags."""
