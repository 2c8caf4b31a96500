"""Weights in and out of the course model, all in this one room.

- `checkpoint`: the shipped tiny checkpoint, saved and loaded with its config (chapter 1);
- `hf_gpt2`: the course's GPT as Hugging Face's `GPT2LMHeadModel` and back (chapter 9);
- `pretrained`: OpenAI's GPT-2 weights, for readers who have them (chapter 1);
- `gguf`: reading a GGUF file: its metadata, and its quantized tensors dequantized (chapter 1);
- `hf_llama`: the Llama-family course model as Hugging Face's `LlamaForCausalLM` and back;
- `smollm2`: the real model, SmolLM2-135M-Instruct, from the GGUF the registry package ships.

Importing this package imports none of them (transformers is slow to import).
"""
