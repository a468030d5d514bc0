"""Tiny reference models for the multi-rank parity tests (module-level factories, so a generated
script can import them as ``tests.distributed.tiny_models:FN``)."""

import torch

from autopar.models.llama import Llama, LlamaConfig


def tiny_llama():
    """dim 64, 4 layers, vocab 128 (at this width the intra-op ILP would replicate the blocks
    on tp; plans keep Megatron's layout, which their estimate costs)."""
    torch.manual_seed(1234)
    return Llama(LlamaConfig(vocab_size=128, dim=64, n_layers=4, n_heads=4, n_kv_heads=2,
                             ffn_dim=128, max_seq_len=64))


def tiny_llama_wide():
    """dim 256 / ffn 1024: wide enough that the ILP picks Megatron column→row TP in blocks."""
    torch.manual_seed(1234)
    return Llama(LlamaConfig(vocab_size=128, dim=256, n_layers=2, n_heads=8, n_kv_heads=4,
                             ffn_dim=1024, max_seq_len=64))


def other_llama():
    """A different model (6 layers), for the wrong-model check."""
    torch.manual_seed(1234)
    return Llama(LlamaConfig(vocab_size=128, dim=64, n_layers=6, n_heads=4, n_kv_heads=2,
                             ffn_dim=128, max_seq_len=64))


def tiny_gpt():
    """GPT (learned positions, fused qkv, tied head), dim 64, 2 layers, vocab 128."""
    from autopar.models.gpt import GPT, GPTConfig

    torch.manual_seed(1234)
    return GPT(GPTConfig(vocab_size=128, max_seq_len=64, dim=64, n_layers=2, n_heads=4))


def tiny_mixtral():
    """Mixtral (top-2 of 4 SwiGLU experts per layer), dim 64, 2 layers, vocab 128."""
    from autopar.models.mixtral import Mixtral, MixtralConfig

    torch.manual_seed(1234)
    return Mixtral(MixtralConfig(vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                 ffn_dim=128, max_seq_len=64, num_experts=4, top_k=2))


def tiny_llama_tied():
    """tiny_llama with its LM head tied to the token embedding (the two sit on the first and
    the last pipeline stage).  The shared matrix starts N(0, 0.02), as GPT-2 initialises it:
    with nn.Embedding's N(0, 1) the first loss is ~61, where fp32 rounding alone is ~4e-6."""
    torch.manual_seed(1234)
    model = Llama(LlamaConfig(vocab_size=128, dim=64, n_layers=4, n_heads=4, n_kv_heads=2,
                              ffn_dim=128, max_seq_len=64, tie_embeddings=True))
    with torch.no_grad():
        model.tok_embeddings.weight.normal_(0.0, 0.02)
    return model


def tiny_llama_math():
    """tiny_llama_wide with unfused attention (score tensors kept), for selective recompute."""
    from autopar.models.common import AttentionImpl

    torch.manual_seed(1234)
    return Llama(LlamaConfig(vocab_size=128, dim=256, n_layers=2, n_heads=8, n_kv_heads=4,
                             ffn_dim=1024, max_seq_len=64, attention=AttentionImpl.MATH))


def tiny_resnet():
    """ResNet with one bottleneck per stage, bottleneck width 8..64, 10 classes (3.5M
    parameters: the stage outputs keep ResNet's 256..2048 channels), for 32x32 images."""
    from autopar.models.resnet import ResNet, ResNetConfig

    torch.manual_seed(1234)
    return ResNet(ResNetConfig(blocks=(1, 1, 1, 1), width_per_group=8, num_classes=10))


def tiny_vit():
    """ViT: 32x32 images in 8x8 patches, dim 64, 2 layers, 4 heads, 10 classes."""
    from autopar.models.vit import ViT, ViTConfig

    torch.manual_seed(1234)
    return ViT(ViTConfig(image_size=32, patch_size=8, dim=64, n_layers=2, n_heads=4, mlp_dim=128,
                         num_classes=10))


# image models: factory → the shape of one input image (the others are token models)
IMAGE_SHAPES = {"tiny_resnet": (3, 32, 32), "tiny_vit": (3, 32, 32)}


def shape_args(factory: str, seq_len: int = 64) -> dict:
    """``autopar.compile``'s shape arguments for a factory's model: ``seq_len`` for a token
    model, ``example_inputs`` (two meta images: the graph scales to any micro-batch, and batch
    norm needs more than one value per channel) for an image model."""
    if factory in IMAGE_SHAPES:
        return {"example_inputs": torch.empty(2, *IMAGE_SHAPES[factory], device="meta")}
    return {"seq_len": seq_len}


def batch(factory: str, model, plan, step: int = 1, seed: int = 0):
    """The synthetic global batch (inputs, labels) for a plan: images and class labels for an
    image model, causal-LM tokens otherwise."""
    from autopar.runtime.train import synthetic_batch, synthetic_images, vocab_size

    size = plan.training.global_batch_size
    if factory in IMAGE_SHAPES:
        return synthetic_images(step, seed, size, IMAGE_SHAPES[factory],
                                model.config.num_classes)
    return synthetic_batch(step, seed, size, plan.training.seq_len, vocab_size(model))
