"""Software presets: the `EstimateOptions` of the training engines people run.

An estimate describes hardware, model and parallel configuration, and also the software that
runs them: its attention kernel, fused kernels, overlap of communication, cross-entropy, the
recompute it does and its fp8 scaling. Each preset below is one engine as its own sources set
it up, named as `compile`'s targets are; `estimate(..., software=NAME)` and
`compile(..., software=NAME)` cost with it, and the report names it. A preset is a documented
choice per engine, never a fitted correction.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.estimate.core import EstimateOptions

__all__ = ["SOFTWARE", "SoftwarePreset", "preset_of", "software_options"]


@dataclass(frozen=True, slots=True)
class SoftwarePreset:
    options: EstimateOptions
    description: str


SOFTWARE: dict[str, SoftwarePreset] = {
    "autopar": SoftwarePreset(
        EstimateOptions(fp32_params=True, fsdp2=True, cp_rotate="ring"),
        "autopar's generated code on PyTorch's engine: eager kernels, SDPA's flash attention, "
        "the cross-entropy on fp32-upcast logits, DDP/FSDP2 gradient reduction overlapped with "
        "backward, fp32 gradient reduction, ZeRO as FSDP2 (without a pipeline, parameters "
        "gathered again every micro-batch, ZeRO-2's gradients reduced every micro-batch; "
        "under one, kept gathered and unreduced through the step), "
        "non-reentrant "
        "checkpointing that stops recomputing "
        "early; fp32 parameters under bf16 autocast, whose cast weights each forward keeps "
        "without ZeRO (FSDP2 gathers bf16 parameters); an fp8 plan's Linear GEMMs in fp8 "
        "with torchao's dynamic tensorwise scaling, eager casts (autopar.runtime.fp8); "
        "context parallel as a K/V ring with fp32 dK/dV accumulators one hop behind"),
    "megatron": SoftwarePreset(
        EstimateOptions(attention_kernel="cudnn", overlap_dp_comm=True, overlap_tp_comm=True,
                        kernels="fused", loss_kernel="megatron", grad_reduce_dtype="bf16",
                        recompute_early_stop=False, fp8_recipe="delayed"),
        "Megatron-LM (Megatron-Core) with Transformer Engine as its performance recipes run "
        "it: TE's cuDNN fused attention and fused norm/activation kernels, --overlap-grad-"
        "reduce, --overlap-param-gather and --tp-comm-overlap, gradients reduced in bf16, its "
        "unfused vocab-parallel cross-entropy on fp32 logits (--cross-entropy-loss-fusion is "
        "opt-in), checkpointing that re-runs whole layers, fp8 by TE's delayed scaling "
        "(--fp8-recipe's default), and context parallel by TE's p2p ring (K/V, then dK/dV "
        "with them in the same dtype)"),
    "torchtitan": SoftwarePreset(
        EstimateOptions(attention_kernel="flash", overlap_dp_comm=True, kernels="eager",
                        loss_kernel="eager", recompute_early_stop=True,
                        fp8_recipe="tensorwise", fp32_params=True,
                        fsdp2=True, cp_rotate="all_gather"),
        "torchtitan without torch.compile: FSDP2 (prefetched all-gathers, reduce-scatters "
        "under backward, without a pipeline parameters gathered again every micro-batch, under "
        "one kept gathered and unreduced through the step), "
        "SDPA flash attention, "
        "eager kernels, the cross-entropy on fp32-"
        "upcast logits, non-reentrant checkpointing, bf16 autocast over fp32 parameters "
        "where FSDP does not cast them (DDP alone), fp8 by torchao's Float8Linear with "
        "dynamic tensorwise scaling (its default recipe), and context parallel by PyTorch's "
        "context_parallel with its default rotate method (K/V all-gathered once a pass, fp32 "
        "dK/dV rotated)"),
    "torchtitan-compile": SoftwarePreset(
        EstimateOptions(attention_kernel="flash", overlap_dp_comm=True, kernels="fused",
                        loss_kernel="fused", recompute_early_stop=True,
                        fp8_recipe="tensorwise", fsdp2=True, cp_rotate="all_gather"),
        "torchtitan with --compile.enable: as 'torchtitan', with inductor fusing the memory-"
        "bound ops (norms, activations, residual adds, fp8 casts) and the loss"),
    "deepspeed": SoftwarePreset(
        EstimateOptions(attention_kernel="flash", overlap_dp_comm=True, kernels="fused",
                        loss_kernel="megatron", zero3_max_live_params=10**9,
                        recompute_early_stop=False, fp8_recipe="delayed"),
        "DeepSpeed with Megatron-DeepSpeed's model: flash attention (--use-flash-attn-v2), "
        "Megatron's fused kernels and vocab-parallel cross-entropy, ZeRO with overlap_comm "
        "and prefetched parameter gathers capped by stage3_max_live_parameters (default "
        "1e9), reentrant activation checkpointing (whole layers), fp8 through Transformer "
        "Engine's delayed scaling"),
}


def software_options(software: str | None, options: EstimateOptions) -> EstimateOptions:
    """The options an estimate or a plan costs with: the preset `software` names, or
    `options` when it names none. Naming a preset and passing other options is refused: change
    a preset's field with dataclasses.replace(SOFTWARE[name].options, field=value)."""
    if software is None:
        return options
    if software not in SOFTWARE:
        raise ValueError(f"software={software!r} is not a preset; presets: "
                         f"{', '.join(SOFTWARE)}")
    if options != EstimateOptions():
        raise ValueError(f"pass software={software!r} or options=EstimateOptions(...), not "
                         f"both; to change a field of the preset, pass options="
                         f"dataclasses.replace(autopar.SOFTWARE[{software!r}].options, ...)")
    return SOFTWARE[software].options


def preset_of(options: EstimateOptions) -> str | None:
    """The name of the preset whose options these are, if one is."""
    return next((name for name, preset in SOFTWARE.items() if preset.options == options), None)
