"""The project's decoder (plain torch, Hugging Face Llama parameter names), its sampler and checkpoint loader."""
from backends.model.config import ModelConfig
from backends.model.generate import generate
from backends.model.llama import LlamaModel, init_weights

__all__ = ["ModelConfig", "LlamaModel", "init_weights", "generate"]
