"""Reference model zoo: GPT, Llama, Mixtral-style MoE, ViT, ResNet / Wide-ResNet.

``build(name_or_config, device="meta")`` makes a model from a preset name (published
dimensions, see ``list_presets()``) or a config dataclass; on the meta device it costs no
memory. Transformer layers live in an ``nn.ModuleList`` named ``layers``.
"""

from autopar.models.gpt import GPT, GPTConfig
from autopar.models.llama import Llama, LlamaConfig
from autopar.models.mixtral import Mixtral, MixtralConfig
from autopar.models.common import AttentionImpl
from autopar.models.registry import build, list_presets, preset
from autopar.models.resnet import ResNet, ResNetConfig
from autopar.models.vit import ViT, ViTConfig

__all__ = [
    "AttentionImpl", "GPT", "GPTConfig", "Llama", "LlamaConfig", "Mixtral", "MixtralConfig",
    "ResNet", "ResNetConfig", "ViT", "ViTConfig", "build", "list_presets", "preset",
]
