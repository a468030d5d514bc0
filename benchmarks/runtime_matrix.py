"""Does every plan run on every model? Models written independently of autopar (the corpus in
``tests/corpus.py``: hand-written and library norms, rotary (torchtitan's as complex products
too) and learned positions, fused and separate q/k/v, tied and untied heads, MoE layers written
as a loop and as batched experts, a ViT, and 70 Hugging Face architectures built from small
configs: Llama, Mistral, Qwen2/3, Mixtral, GPT-2, Phi-2/3, GPT-NeoX, Gemma 2/3, OLMo 1/2/3,
StarCoder, OPT, Falcon, BLOOM, BERT, Qwen3-MoE, OLMoE, DeepSeek-V2/V3, GPT-J, StableLM, Cohere,
Granite, StarCoder2, Persimmon, MPT, CodeGen, Nemotron, GLM, EXAONE 4, SmolLM3, GraniteMoE,
Qwen2-MoE, PhiMoE, DBRX, Llama 4, GPT-OSS, Ministral, Doge, LFM2, Ernie 4.5 MoE, GLM-4 MoE,
Qwen3-Next, MiniMax, Falcon-H1, BitNet, Jamba and more: ``tests/corpus.py``) times
plans pinned at compile time (dp, ZeRO-1/2/3, tp, tp+sp, pp with each schedule, cp, ep, and
their 3-D/4-D combinations on 2-8 CPU ranks with gloo). autopar's own models run too, by their
names in ``tests/distributed/tiny_models.py`` (``--models tiny_llama,tiny_gpt``).

Each cell is compiled by ``autopar.compile`` for the cpu-gloo profile, applied with
``autopar.runtime.apply_plan`` under ``torchrun`` and trained for 3 AdamW steps next to a
one-process reference of the same model on the same batches (``runtime_matrix_worker.py``).
A cell shows the largest relative loss difference over the steps and, after the first
backward, the largest gradient difference relative to the largest reference gradient; "ok"
when they are within 1e-4 and 1e-5.  A plan compile refuses shows "refused: <reason>"; a
plan that compiled and then failed shows "FAIL: <error>".  ep plans apply to MoE models only.

With ``--dtype fp8`` the plans are compiled for dgx-h100 (the CPU profile has no fp8 rate)
and the reference runs in fp8 too (`autopar.runtime.precision`). Each rank scales the shards
it holds (its batch slice, its weight shards), so its fp8 rounding differs from the
reference's, by about as much as fp8 rounding moves the reference from a bf16 run of it (the
"gap", measured per cell on the same batches): "ok" within 3 times the gap, and 1e-3 / 1e-2
where that is smaller. A sharded run's rounding is another draw of the same size (a one-rank
fp8 run in two halves of the batch differs from the whole batch's by 0.7-1.2x the gap in the
gradients, `dp` cells up to 2.6x in the loss of the ViT, whose loss averages 8 images), where a
wrong layout or reduction moves the losses by 1e-2 or more and gradients by their own size.

    python benchmarks/runtime_matrix.py [--models plain_llama,hf_llama] [--plans tp,pp_1f1b]
                                        [--dtype fp8]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
WORKER = Path(__file__).with_name("runtime_matrix_worker.py")

LOSS_TOL, GRAD_TOL = 1e-4, 1e-5
FP8_GAPS = 3  # an fp8 cell is ok within this many times its reference's fp8-vs-bf16 gap
FP8_FLOOR = (1e-3, 1e-2)  # loss, gradient: an fp8 cell's least tolerance (bf16 arithmetic)
GLOBAL_BATCH, SEQ_LEN, STEPS = 8, 64, 3
MB2 = {"micro_batch_size": 2}

# name -> (ranks, constraints pinned in autopar.compile)
PLANS: dict[str, tuple[int, dict]] = {
    "dp": (2, {"dp": 2, "zero_stage": 0}),
    "zero1": (2, {"dp": 2, "zero_stage": 1}),
    "zero2": (2, {"dp": 2, "zero_stage": 2}),
    "zero3": (2, {"dp": 2, "zero_stage": 3}),
    # two micro-batches a rank: FSDP2 gathers again for each; in a pipeline, once a step
    # (EstimateOptions.fsdp2)
    "zero1_mb2": (2, {"dp": 2, "zero_stage": 1, **MB2}),
    "zero2_mb2": (2, {"dp": 2, "zero_stage": 2, **MB2}),
    "zero3_mb2": (2, {"dp": 2, "zero_stage": 3, **MB2}),
    "zero1_pp": (4, {"dp": 2, "pp": 2, "zero_stage": 1, "pp_schedule": "1f1b", **MB2}),
    "zero3_pp": (4, {"dp": 2, "pp": 2, "zero_stage": 3, "pp_schedule": "1f1b", **MB2}),
    "zero3_gpipe": (4, {"dp": 2, "pp": 2, "zero_stage": 3, "pp_schedule": "gpipe", **MB2}),
    "tp": (2, {"tp": 2, "sequence_parallel": False}),
    "tp_sp": (2, {"tp": 2, "sequence_parallel": True}),
    # one sequence per micro-batch: the intra-op ILP runs MLPs replicated on the sequence shard
    "tp_sp_mb1": (2, {"tp": 2, "sequence_parallel": True, "micro_batch_size": 1}),
    "tp_sp_per_op": (2, {"tp": 2, "sequence_parallel": True, "recompute": "per_op"}),
    "tp_full": (2, {"tp": 2, "sequence_parallel": False, "recompute": "full"}),
    "tp_sp_full": (2, {"tp": 2, "sequence_parallel": True, "recompute": "full"}),
    "cp_full": (2, {"cp": 2, "recompute": "full"}),
    "dp_per_op": (2, {"dp": 2, "zero_stage": 0, "recompute": "per_op"}),
    "pp_gpipe": (2, {"pp": 2, "pp_schedule": "gpipe", **MB2}),
    "pp_1f1b": (2, {"pp": 2, "pp_schedule": "1f1b", **MB2}),
    "pp_interleaved": (2, {"pp": 2, "pp_schedule": "interleaved-1f1b", "virtual_stages": 2,
                           "micro_batch_size": 1}),
    "pp_zero_bubble": (2, {"pp": 2, "pp_schedule": "zero-bubble", **MB2}),
    "cp": (2, {"cp": 2}),
    "cp_zero3": (4, {"dp": 2, "cp": 2, "zero_stage": 3}),
    "cp_pp": (4, {"cp": 2, "pp": 2, "pp_schedule": "1f1b", **MB2}),
    "ep": (2, {"dp": 2, "ep": 2}),
    "ep_zero3": (4, {"dp": 4, "ep": 2, "zero_stage": 3}),
    # experts reduced over their own replicas by FSDP2 inside the checkpointed blocks
    "ep_zero3_per_op": (4, {"dp": 4, "ep": 2, "zero_stage": 3, "recompute": "per_op"}),
    "ep_pp": (4, {"dp": 2, "ep": 2, "pp": 2, "pp_schedule": "1f1b", **MB2}),
    "tp_zero3": (4, {"dp": 2, "tp": 2, "zero_stage": 3, "sequence_parallel": True}),
    # FSDP2 makes each tp gradient whole on its own in every reduce-scatter pass
    "tp_zero2_mb2": (4, {"dp": 2, "tp": 2, "zero_stage": 2, "sequence_parallel": True,
                         **MB2}),
    "tp_pp": (4, {"tp": 2, "pp": 2, "pp_schedule": "1f1b", "sequence_parallel": False, **MB2}),
    "tp_sp_pp": (4, {"tp": 2, "pp": 2, "pp_schedule": "1f1b", "sequence_parallel": True,
                     **MB2}),
    "ep_tp": (4, {"dp": 2, "tp": 2, "ep": 2}),
    "ep_tp_zero1": (8, {"dp": 4, "tp": 2, "ep": 2, "zero_stage": 1}),
    "dp_tp_pp": (8, {"dp": 2, "tp": 2, "pp": 2, "zero_stage": 1, "pp_schedule": "1f1b",
                     **MB2}),
    # fewer micro-batches (1) than pipeline ranks: GPipe runs it
    "pp_gpipe_mb8": (2, {"pp": 2, "pp_schedule": "gpipe", "micro_batch_size": 8}),
    "zero2_full": (2, {"dp": 2, "zero_stage": 2, "recompute": "full"}),
    "tp_sp_dp": (4, {"dp": 2, "tp": 2, "zero_stage": 0, "sequence_parallel": True}),
    "dp_pp_gpipe": (4, {"dp": 2, "pp": 2, "zero_stage": 0, "pp_schedule": "gpipe", **MB2}),
    # another mesh order: dp innermost, the tp groups 2 ranks apart
    "tp_zero3_dp_inner": (4, {"dp": 2, "tp": 2, "zero_stage": 3, "sequence_parallel": True,
                              "mesh_order": ("pp", "tp", "cp", "dp")}),
    "cp_tp": (4, {"cp": 2, "tp": 2, "sequence_parallel": False}),
    "cp_tp_sp": (4, {"cp": 2, "tp": 2, "sequence_parallel": True}),
    # tp outside cp: the (tp, cp) activations' sequence split over tp first
    "cp_tp_sp_tp_outer": (4, {"cp": 2, "tp": 2, "sequence_parallel": True,
                              "mesh_order": ("pp", "tp", "cp", "dp")}),
    # FSDP2 shards the tp DTensors again over dp x cp; a pipeline of (cp, tp) activations
    "cp_tp_zero3": (4, {"cp": 2, "tp": 2, "zero_stage": 3, "sequence_parallel": True}),
    "cp_tp_sp_pp": (8, {"cp": 2, "tp": 2, "pp": 2, "pp_schedule": "1f1b",
                        "sequence_parallel": True, **MB2}),
    # cp outside dp: the gradients average over a (dp, cp) mesh sliced out of order, and the
    # expert groups come from it
    "cp_zero2_cp_outer": (4, {"dp": 2, "cp": 2, "zero_stage": 2,
                              "mesh_order": ("cp", "pp", "dp", "tp")}),
    "ep_cp": (2, {"cp": 2, "ep": 2}),
    "ep_cp_tp": (4, {"cp": 2, "tp": 2, "ep": 2, "sequence_parallel": True}),
    "ep_cp_outer": (4, {"dp": 2, "ep": 2, "cp": 2, "zero_stage": 0,
                        "mesh_order": ("cp", "tp", "pp", "dp")}),
    "zero3_tp_pp": (8, {"dp": 2, "tp": 2, "pp": 2, "zero_stage": 3, "pp_schedule": "1f1b",
                        "sequence_parallel": False, **MB2}),
}
EXPERT_PLANS = ("ep", "ep_zero3", "ep_zero3_per_op", "ep_pp", "ep_tp", "ep_tp_zero1",
                "ep_cp", "ep_cp_tp", "ep_cp_outer")
MOE_MODELS = ("moe_loop", "moe_batched", "hf_mixtral", "hf_qwen3_moe", "hf_deepseek_v3", "hf_olmoe",
              "tiny_mixtral", "hf_granitemoe", "hf_qwen2_moe", "hf_phimoe", "hf_dbrx",
              "hf_llama4", "hf_gpt_oss", "hf_deepseek_v2", "hf_flexolmo", "hf_ernie45_moe",
              "hf_glm4_moe", "hf_qwen3_next", "hf_minimax", "hf_jamba")


@dataclass
class Cell:
    model: str
    plan: str
    status: str = ""  # "ok", "refused: ...", "FAIL: ...", or the differences
    loss_err: float | None = None
    grad_err: float | None = None
    detail: dict = field(default_factory=dict)
    dtype: str = "fp32"

    @property
    def tolerance(self) -> tuple[float, float]:
        if self.dtype != "fp8":
            return LOSS_TOL, GRAD_TOL
        return (max(FP8_FLOOR[0], FP8_GAPS * self.detail.get("fp8_loss_gap", 0.0)),
                max(FP8_FLOOR[1], FP8_GAPS * self.detail.get("fp8_grad_gap", 0.0)))

    @property
    def ok(self) -> bool:
        loss_tol, grad_tol = self.tolerance
        return self.loss_err is not None and self.loss_err <= loss_tol \
            and self.grad_err <= grad_tol

    def text(self) -> str:
        if self.loss_err is None:
            return self.status
        gap = (f" (gap {self.detail['fp8_loss_gap']:.1e}/{self.detail['fp8_grad_gap']:.1e})"
               if "fp8_loss_gap" in self.detail else "")
        return f"{'ok' if self.ok else 'DIVERGED'} {self.loss_err:.1e}/{self.grad_err:.1e}{gap}"


def _corpus():
    sys.path.insert(0, str(TESTS))
    import corpus

    return corpus


def factory(name: str):
    """The model factory called ``name``: a corpus model's, or one of autopar's own models in
    ``tests/distributed/tiny_models.py``."""
    corpus = _corpus()
    if hasattr(corpus, name):
        return getattr(corpus, name)
    sys.path.insert(0, str(TESTS / "distributed"))
    import tiny_models

    return getattr(tiny_models, name)


def compile_cell(model_name: str, plan_name: str, out_dir: Path,
                 dtype: str = "fp32") -> tuple[Cell, Path | None]:
    """Compile one cell's plan; the cell says why when compile refuses it."""
    import torch

    import autopar

    corpus = _corpus()
    ranks, pins = PLANS[plan_name]
    cell = Cell(model_name, plan_name, dtype=dtype)
    if plan_name in EXPERT_PLANS and model_name not in MOE_MODELS:
        cell.status = "n/a (dense)"
        return cell, None
    with torch.device("meta"):
        model = factory(model_name)()
    cluster = autopar.Cluster.from_profile("dgx-h100" if dtype == "fp8" else "cpu-gloo",
                                           gpus_per_node=ranks)
    if model_name in corpus.IMAGE_MODELS:
        shape = {"example_inputs": (torch.empty(GLOBAL_BATCH, *corpus.IMAGE_SHAPE,
                                                device="meta"),)}
    else:
        shape = {"seq_len": SEQ_LEN}
    try:
        plan = autopar.compile(model, cluster, global_batch_size=GLOBAL_BATCH, dtype=dtype,
                               constraints=pins, **shape)
    except ValueError as exc:
        cell.status = "refused: " + str(exc).splitlines()[0][:160]
        return cell, None
    path = out_dir / (f"{model_name}.{plan_name}.json" if dtype == "fp32" else
                      f"{model_name}.{plan_name}.{dtype}.json")
    plan.save(path)
    return cell, path


def run_cells(cells: list[tuple[Cell, Path]], ranks: int, out_dir: Path,
              timeout_s: float | None = None) -> None:
    """Train every compiled cell of one rank count in one torchrun launch; fills the cells.
    When a launch crashes or hangs (``timeout_s``, by default 90 s and 15 s per cell and
    rank), the first cell it did not finish runs again alone (a rank may die in a cell before
    another wrote the cell before it) and fails if that launch fails too; the cells after it
    go on in a new launch."""
    pending, alone = list(cells), False
    while pending:
        batch = pending[:1] if alone else pending
        results = {path: [out_dir / f"{path.stem}.{r}.json" for r in range(ranks)]
                   for _, path in batch}
        for files in results.values():
            for f in files:
                f.unlink(missing_ok=True)
        proc = _launch([p for _, p in batch], [c.model for c, _ in batch], ranks, out_dir,
                       90 + 15 * ranks * len(batch) if timeout_s is None else timeout_s)
        finished = {p for p, files in results.items() if all(f.is_file() for f in files)}
        for cell, path in batch:
            if path in finished:
                _fill(cell, [json.loads(f.read_text()) for f in results[path]])
        if alone and not finished:
            lines = [line for line in (proc.stderr or proc.stdout).splitlines()
                     if line.strip(" =")]  # not torchrun's rules around its failure report
            tail = next((line for line in reversed(lines) if "Error" in line),
                        lines[-1] if lines else "no output")
            batch[0][0].status = f"FAIL: worker exited {proc.returncode}: {tail[:160]}"
        done = finished | ({batch[0][1]} if alone else set())  # a cell alone ran or failed
        pending = [(c, p) for c, p in pending if p not in done]
        alone = not alone and bool(pending)


def _launch(paths: list[Path], models: list[str], ranks: int, out_dir: Path,
            timeout_s: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(TESTS), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    specs = [f"{path}:{model}" for path, model in zip(paths, models)]
    try:
        proc = subprocess.run([torchrun, "--standalone", f"--nproc_per_node={ranks}",
                               str(WORKER), str(out_dir), str(STEPS), *specs], env=env,
                              capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc = subprocess.CompletedProcess([], returncode=-1, stdout="",
                                           stderr=f"no result after {timeout_s:.0f} s")
    if os.environ.get("AUTOPAR_MATRIX_TRACEBACK"):
        sys.stderr.write(proc.stderr)
    return proc


def _fill(cell: Cell, rows: list[dict]) -> None:
    """A trained cell's status from its ranks' results."""
    errors = [row["error"] for row in rows if row.get("error")]
    if errors:
        cell.status = "FAIL: " + errors[0][:160]
        return
    cell.loss_err = max(row["loss_err"] for row in rows)
    cell.grad_err = max(row["grad_err"] for row in rows)
    cell.detail = rows[0]
    for key in ("fp8_loss_gap", "fp8_grad_gap"):  # each rank's reference: the same batches
        if key in rows[0]:
            cell.detail[key] = max(row[key] for row in rows)


def run_matrix(models: list[str], plans: list[str], out_dir: Path,
               dtype: str = "fp32") -> list[Cell]:
    """Every plan on every model (`run_pairs`)."""
    return run_pairs([(m, p) for m in models for p in plans], out_dir, dtype)


def run_pairs(pairs: list[tuple[str, str]], out_dir: Path, dtype: str = "fp32") -> list[Cell]:
    """Compile each (model, plan) cell, then train the compiled ones: one launch per rank
    count, each cell's error its own (`run_cells`)."""
    by_ranks: dict[int, list[tuple[Cell, Path]]] = {}
    cells = []
    for model, plan in pairs:
        cell, path = compile_cell(model, plan, out_dir, dtype)
        cells.append(cell)
        if path is not None:
            by_ranks.setdefault(PLANS[plan][0], []).append((cell, path))
    for ranks, group in sorted(by_ranks.items()):
        run_cells(group, ranks, out_dir)
    return cells


def table(cells: list[Cell], models: list[str], plans: list[str]) -> str:
    by = {(c.model, c.plan): c for c in cells}
    lines = ["| model | " + " | ".join(plans) + " |", "|---" * (len(plans) + 1) + "|"]
    for m in models:
        lines.append(f"| {m} | " + " | ".join(by[m, p].text() for p in plans) + " |")
    notes = sorted({c.text() for c in cells if c.loss_err is None and not c.text().startswith("n/a")})
    return "\n".join(lines + ([""] + [f"- {n}" for n in notes] if notes else []))


def main(argv: list[str] | None = None) -> None:
    corpus = _corpus()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(corpus.TOKEN_MODELS + corpus.IMAGE_MODELS))
    ap.add_argument("--plans", default=",".join(PLANS))
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "fp8"))
    args = ap.parse_args(argv)
    models, plans = args.models.split(","), args.plans.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        cells = run_matrix(models, plans, Path(tmp), args.dtype)
    within = (f"{FP8_GAPS} times the fp8 reference's gap from a bf16 one (shown), at least "
              f"{FP8_FLOOR[0]:g} / {FP8_FLOOR[1]:g}" if args.dtype == "fp8"
              else f"{LOSS_TOL:g} / {GRAD_TOL:g}")
    print(f"{args.dtype} plans: max relative loss difference over {STEPS} steps / max gradient "
          f"difference after the first backward (relative to the largest reference "
          f"gradient); ok within {within}\n")
    print(table(cells, models, plans))


if __name__ == "__main__":
    main()
