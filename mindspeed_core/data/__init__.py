"""Datasets (Megatron indexed .bin/.idx, instruction and preference data), written without any
framework. Filled by the training and fine-tuning issues."""
