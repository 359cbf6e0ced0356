"""Image and video input for vision-language checkpoints (Qwen3.5): what front ends resize images
with (preprocess.py) and decode and sample videos with (video.py), the media a request carries
(image.py), how the offline API fetches media URLs (fetch.py), where a prompt's images and video
patches sit and the multimodal RoPE positions they give (prompt.py), the vision encoder
(encoder.py) and its outputs at a step's image and video tokens (features.py)."""
