"""selfdraft: self-drafting speculative decoding on unmodified Hugging Face causal LMs.

Nothing heavy happens at import time; import the submodules you need, or these names.
"""

from selfdraft.generate import GenerationConfig, GenerationOutput, generate
from selfdraft.sampling import SamplingConfig

__all__ = ["GenerationConfig", "GenerationOutput", "SamplingConfig", "generate"]
__version__ = "0.1.0"
