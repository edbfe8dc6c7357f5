"""Conventions of Megatron-LM and MindSpeed-LLM: flag names now; checkpoint layouts and
Hugging Face mappings later."""
