"""Reference models built from podscale's layers."""
from podscale.models.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
