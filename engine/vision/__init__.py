"""Image input for vision-language checkpoints (Qwen3.5): the processor front ends resize images
with (preprocess.py), where a prompt's images sit and the multimodal RoPE positions they give
(prompt.py), the vision encoder (encoder.py) and its outputs at a step's image tokens
(features.py)."""
