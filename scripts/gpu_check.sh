#!/usr/bin/env bash
# Validate sweeper's GPU path (Transformer Engine specs, BF16/FP8/MXFP8, MoE, MLA, hybrid Mamba) on ONE GPU in
# minutes: one real `python -m sweeper trial --json` per case on a 1 node x 1 GPU search space that carries this
# GPU's real compute capability and memory, next to `python -m sweeper plan --json --only ...`'s prediction.
#
#   scripts/gpu_check.sh            # PYTHON=... to pick the interpreter; SWEEPER_GPU_CHECK_KEEP=1 keeps the trials
#                                   # GPU_CHECK_ONLY="bf16-dense issue44" runs those cases and groups only
#                                   #   (groups: issue30, issue44; a case may be in both);
#                                   # GPU_CHECK_WARM_RANKS=true forks ranks from warm ones (cluster.warm_ranks)
#                                   # GPU_CHECK_TRIAL_TIMEOUT_S=120 bounds each trial (default 600)
#                                   # GPU_CHECK_BUDGET_S=540 starts no case after that many seconds (default 540,
#                                   #   0: none), so the table comes within a 10-minute limit; the rest say skipped
#                                   # GPU_CHECK_WHEELHOUSE=DIR installs sweeper offline first (below)
#   scripts/gpu_check.sh --plan-only  # no GPU needed: writes the spaces and runs only `plan` for a pretend device
#                                     # (GPU_CHECK_DEVICE="CC GIB NGPU TE MAMBA CONV NAME", default an H100-like one)
#
# Offline install (GPU nodes that reach no package registry): GPU_CHECK_WHEELHOUSE=DIR, a wheelhouse made by
# `python scripts/wheelhouse.py DIR` on a connected machine, makes a venv with --system-site-packages in the check's
# temporary folder (so the machine's own torch and Transformer Engine are used), runs scripts/install_offline.sh DIR
# into it (about a minute) and runs every case with that venv's python; exit 3 when the install fails. In one call:
#   GPU_CHECK_WHEELHOUSE=wheels GPU_CHECK_ONLY=issue44 GPU_CHECK_TRIAL_TIMEOUT_S=120 scripts/gpu_check.sh
# (a case that hangs costs up to twice GPU_CHECK_TRIAL_TIMEOUT_S, its reference's run and its trial, past the budget)
#
# Prints one table (case, status, tokens/s, the steps' reserved peak beside the peak before the steps (build,
# reference load, gate), peak memory predicted, memory outside torch, the checkpoint phase's peak, notes) and exits 1
# if any case ran and failed (unsupported, refused (pruned), skipped and expected outcomes do not count), 2 if there
# is no CUDA device. Idempotent: everything is written to a fresh temporary folder but the equivalence references
# (sweeps/gpu-check-*/reference, reused by name); nothing is downloaded (HF_HUB_OFFLINE=1, synthetic tokens, tiny
# models). Cases that need more than one GPU (SP needs TP>1, CP>1, DP>1 for the overlapped reduce, EP2) run only
# when a second GPU is visible.
#
# Group issue30, each of its items once: BF16, FP8 delayed, FP8 blockwise (run.fp8_recipe, where CUDA >= 12.9
# allows), a local CUDA graph at micro-batch 1 and 2 (graphs are recorded on the first forward/backward, the
# equivalence gate's), the DP overlaps (Bridge's defaults), a Megatron-Bridge model (model: {hf: DIR}) when Bridge
# is installed, MoE, MLA, a 1.2B dense model at mbs 1 and 2, hybrid Mamba. About 10 minutes on one GPU (12 with
# Bridge and mamba_ssm installed: the budget then skips the last ones).
# Group issue44, its items on a GPU (about 7 minutes on one GPU, 9 with two):
#   bf16-dense                the reference case: fresh rank actors (warm ranks off), its BF16 reference shared
#   bf16-graph-mbs2           local graphs below compute capability 10 (item 2), recorded on the gate's mbs 1 (3)
#   bf16-moe-graph-local      local graphs on dropless MoE (4): refused before launch by rules.local_graphs_dropless_moe
#                             (status pruned, a few seconds), or, without that rule, whether it runs
#   bf16-moe-a2a-ep2          moe_a2a_overlap at EP2: the combined 1F1B schedule's forward step (1); two GPUs
#   fp8-dense-bf16-ref        FP8 in a [bf16, fp8] space, gated against the space's BF16 reference (5)
#   fp8-bridge-params         run.framework megatron-bridge: FP8 parameters (Bridge's default), its fusions (8) and
#                             the checkpoint round trip of FP8 weights and TE's extra state (14)
#   mxfp8-fp8-params          MXFP8 with FP8 parameters through the grad buffer (10); compute capability 10.x only
#   bf16-cc-mismatch          cluster.compute_capability other than the card's (6): expected failed:infra, one line
#   bf16-dense-tp2-sp         TP2 + SP through TE; two GPUs
#   bf16-dense-warm           warm forked ranks that keep the driver's /dev/nvidia* descriptors (16)
#   bf16-dense-warm-closefds  the same with SWEEPER_FORK_CLOSE_DEVICE_FILES=1 (the child closes them, as on the first
#                             GPU run, where NCCL's nvmlInit failed): a diagnosis, either outcome is shown, not failed
#   every case: the steps' peak next to the peak before the steps (13)
# About a minute per case on one H100/H200 (Ray start, a one-GPU reference unless the space shares one, the trial);
# refused cases a few seconds; everything at once about 14 minutes on one GPU, so GPU_CHECK_BUDGET_S skips what
# would not fit: run the groups in separate calls.
# First run: one H200 without Transformer Engine (docs/support-matrix.md, "The first GPU run").
set -uo pipefail

WHEELHOUSE=
if [[ -n ${GPU_CHECK_WHEELHOUSE:-} ]] && ! WHEELHOUSE=$(cd "$GPU_CHECK_WHEELHOUSE" 2>/dev/null && pwd); then
    echo "gpu_check: GPU_CHECK_WHEELHOUSE=$GPU_CHECK_WHEELHOUSE is not a folder" >&2
    exit 3
fi
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
WORK=$(mktemp -d -t sweeper-gpu-check.XXXXXX)
if [[ -z "${SWEEPER_GPU_CHECK_KEEP:-}" ]]; then trap 'rm -rf "$WORK"' EXIT; else echo "trials kept in $WORK"; fi

PLAN_ONLY=
[[ ${1:-} == --plan-only ]] && PLAN_ONLY=1
BUDGET_S=${GPU_CHECK_BUDGET_S:-540}
CASE_S=60  # what a case takes, about: one starts only when this much of the budget is left

# -- offline install: a venv over the machine's torch and TE, the rest from the wheelhouse ---------------------------
if [[ -n $WHEELHOUSE ]]; then
    VENV="$WORK/venv"
    echo "installing sweeper from $WHEELHOUSE into $VENV (system site-packages: this machine's torch and TE)" >&2
    # Without pip of its own: a venv's bundled pip and setuptools (3.11's) would shadow the machine's, and torch's
    # requirement on setuptools would then ask the wheelhouse, which leaves torch's own dependencies out.
    "$PY" -m venv --system-site-packages --without-pip "$VENV" >"$WORK/install.log" 2>&1
    # A PYTHON that is itself a venv's keeps its torch, TE and pip out of the system site-packages: a .pth file adds
    # its site-packages after the new venv's own (for the system's python they are those already).
    "$PY" -c 'import site; print("\n".join(site.getsitepackages()))' \
        >"$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/gpu_check_python.pth"
    if ! PYTHON="$VENV/bin/python" scripts/install_offline.sh "$WHEELHOUSE" >>"$WORK/install.log" 2>&1; then
        echo "gpu_check: the offline install from $WHEELHOUSE failed; its log's last lines:" >&2
        tail -n 5 "$WORK/install.log" >&2
        exit 3
    fi
    tail -n 1 "$WORK/install.log" >&2
    PY="$VENV/bin/python"
fi

# -- the device: compute capability, memory, count; optional kernels ----------------------------------------------
if [[ -n $PLAN_ONLY ]]; then
    DEVICE=${GPU_CHECK_DEVICE:-"9.0 80 1 yes yes yes pretend-device"}
elif ! DEVICE=$("$PY" - <<'EOF'
import importlib.util, sys
import torch
if not torch.cuda.is_available():
    sys.exit(1)
major, minor = torch.cuda.get_device_capability(0)
props = torch.cuda.get_device_properties(0)
def has(name):
    try:
        __import__(name)
        return "yes"
    except Exception:
        return "no"
print(f"{major}.{minor} {props.total_memory / 2**30:.0f} {torch.cuda.device_count()} "
      f"{has('transformer_engine')} {has('mamba_ssm')} {has('causal_conv1d')} {props.name.replace(' ', '_')}")
EOF
); then
    echo "gpu_check: no CUDA device visible to $PY (torch.cuda.is_available() is False)" >&2
    exit 2
fi
read -r CC MEM_GIB NGPU HAS_TE HAS_MAMBA HAS_CONV GPU_NAME <<<"$DEVICE"
echo "device: $GPU_NAME, compute capability $CC, ${MEM_GIB} GiB, $NGPU visible; transformer_engine=$HAS_TE" \
     "mamba_ssm=$HAS_MAMBA causal_conv1d=$HAS_CONV"
# Without TE the trials build megatron-core's local spec, whose unfused attention keeps its score matrices: the
# predictions price that (estimate.attention_backend: local), so measured and predicted memory compare like for like.
ATTENTION=flash
if [[ $HAS_TE != yes ]]; then
    echo "warning: Transformer Engine does not import: trials use the CPU-path layer specs" >&2
    ATTENTION=local
fi
has_module() { "$PY" -c "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('$1') else 1)" \
    2>/dev/null && echo yes || echo no; }
HAS_BRIDGE=no CUDA_OK=yes
if [[ -z $PLAN_ONLY ]]; then
    HAS_BRIDGE=$(has_module megatron.bridge)
    CUDA_OK=$("$PY" -c "import torch; v = tuple(int(x) for x in (torch.version.cuda or '0.0').split('.')[:2]); \
print('yes' if v >= (12, 9) else 'no')")
fi
cc_at_least() { "$PY" -c "import sys; a=tuple(map(int,'$CC'.split('.'))); sys.exit(0 if a >= ($1,$2) else 1)"; }

# -- small models (each a YAML model section) -----------------------------------------------------------------------
DENSE='{name: gpu-check-dense, num_layers: 4, hidden_size: 1024, ffn_hidden_size: 4096, num_attention_heads: 16,
  num_query_groups: 4, vocab_size: 32000, max_position_embeddings: 4096}'
MOE='{name: gpu-check-moe, num_layers: 4, hidden_size: 1024, ffn_hidden_size: 2048, num_attention_heads: 16,
  num_query_groups: 4, vocab_size: 32000, max_position_embeddings: 4096, num_moe_experts: 8, moe_router_topk: 2,
  moe_ffn_hidden_size: 1024, moe_shared_expert_intermediate_size: 1024}'
MLA='{name: gpu-check-mla, num_layers: 4, hidden_size: 1024, ffn_hidden_size: 2816, num_attention_heads: 16,
  vocab_size: 32000, max_position_embeddings: 4096, num_moe_experts: 8, moe_router_topk: 2, moe_ffn_hidden_size: 512,
  moe_shared_expert_intermediate_size: 1024, moe_first_k_dense: 1, multi_latent_attention: true, qk_layernorm: true,
  kv_lora_rank: 256, qk_head_dim: 64, qk_pos_emb_head_dim: 32, v_head_dim: 64}'
HYBRID='{name: gpu-check-hybrid, num_layers: 8, hidden_size: 1024, ffn_hidden_size: 2048, num_attention_heads: 16,
  num_query_groups: 2, kv_channels: 64, vocab_size: 32000, max_position_embeddings: 4096, gated_linear_unit: false,
  position_embedding_type: none, num_moe_experts: 8, moe_router_topk: 2, moe_ffn_hidden_size: 1024,
  hybrid_layer_pattern: "ME*EM-ME", mamba_num_heads: 32, mamba_head_dim: 64, mamba_num_groups: 8,
  mamba_state_dim: 64}'
# A 1.2B-parameter dense model at sequence 2048: activations, not overheads, dominate its peak, so its measured vs
# predicted memory and its tokens/s say something about production sizes (the 4-layer models above do not).
DENSE_1B='{name: gpu-check-dense-1b, num_layers: 24, hidden_size: 2048, ffn_hidden_size: 5632, num_attention_heads: 16,
  num_query_groups: 4, vocab_size: 32000, max_position_embeddings: 4096}'
TRAINING_1B="{seq_length: 2048, global_batch_size: 8, steps: 6, warmup_steps: 2, checkpoint: false,
  trial_timeout_s: ${GPU_CHECK_TRIAL_TIMEOUT_S:-600}}"

# A trial's wall-time limit (GPU_CHECK_TRIAL_TIMEOUT_S): a hang costs this much, not the whole check.
DEFAULT_TRAINING="{seq_length: 1024, global_batch_size: 8, steps: 6, warmup_steps: 2, checkpoint: true,
  trial_timeout_s: ${GPU_CHECK_TRIAL_TIMEOUT_S:-600}}"

# write_space NAME MODEL PRECISION GPUS [RUN] [AXES] -> the YAML's path (RUN: the run section, a YAML flow mapping;
# AXES: more space axes, ", key: [values]..."; PRECISION: the precision values, the first one the reference's).
# Read from the caller's assignments: SPACE (another case's space name, so its reference is reused), TRAINING,
# EP (the space's ep values), CC_DECLARED (cluster.compute_capability instead of this GPU's).
write_space() {
    local file="$WORK/$1.yaml"
    cat >"$file" <<EOF
name: gpu-check-${SPACE:-$1}
model: $2
cluster: {nodes: 1, gpus_per_node: $4, gpu_memory_gib: $MEM_GIB, compute_capability: "${CC_DECLARED:-$CC}",
          address: local, simulate: false, warm_ranks: ${GPU_CHECK_WARM_RANKS:-null}}
training: ${TRAINING:-$DEFAULT_TRAINING}
run: ${5:-"{}"}
estimate: {attention_backend: $ATTENTION}
space: {gpus: [$4], tp: [1, 2], sp: [false, true], ep: [${EP:-1}], precision: [$3]${6:-}}
search: {max_trials: 1, parallel: 1, confirm_top: 0}
EOF
    echo "$file"
}

ROWS="$WORK/rows.tsv"
: >"$ROWS"
skip() { printf '%s\tskipped\t-\t-\t-\t-\t-\t-\t%s\n' "$1" "$2" >>"$ROWS"; }

# The group(s) of the cases that follow (GPU_CHECK_ONLY may name a group instead of each case).
GROUP=issue30
selected() {
    local group
    [[ -z ${GPU_CHECK_ONLY:-} || " $GPU_CHECK_ONLY " == *" $1 "* ]] && return 0
    for group in $GROUP; do [[ " $GPU_CHECK_ONLY " == *" $group "* ]] && return 0; done
    return 1
}

# run_case NAME MODEL PRECISION LAYOUT [GPUS] [RUN] [AXES]; besides write_space's, read from the caller's
# assignments: EXPECT, the outcomes that are the case's success besides passed ("failed:infra": a refusal the case
# shows; "any": a diagnosis, whatever it finds), and EXPECT_ERROR, text the trial's error must then contain.
run_case() {
    local name=$1 model=$2 precision=$3 layout=$4 gpus=${5:-1} space plan_rc=0
    if ! selected "$name"; then
        skip "$name" "not in GPU_CHECK_ONLY"
        return
    fi
    if [[ -z $PLAN_ONLY && $BUDGET_S -gt 0 && $((SECONDS + CASE_S)) -gt $BUDGET_S ]]; then
        skip "$name" "GPU_CHECK_BUDGET_S=$BUDGET_S: ${SECONDS} s spent, a case takes about ${CASE_S} s"
        return
    fi
    space=$(write_space "$name" "$model" "$precision" "$gpus" "${6:-}" "${7:-}")
    echo "== $name: $layout ($(date +%T))" >&2
    "$PY" -m sweeper plan "$space" --json --only "$layout" >"$WORK/$name.plan.json" 2>"$WORK/$name.plan.err" \
        || plan_rc=$?
    if [[ -n $PLAN_ONLY || $plan_rc -ne 0 ]]; then
        echo '{"status": "planned", "metrics": {}, "notes": []}' >"$WORK/$name.trial.json"
    else
        "$PY" -m sweeper trial "$space" --layout "$layout" --json --out "$WORK/$name.trial" \
            >"$WORK/$name.trial.json" 2>"$WORK/$name.trial.err"
    fi
    "$PY" - "$name" "$WORK/$name.trial.json" "$WORK/$name.plan.json" "$WORK/$name.trial.err" \
        "$WORK/$name.plan.err" "$plan_rc" "${EXPECT:-}" "${EXPECT_ERROR:-}" >>"$ROWS" <<'EOF'
import json, sys
name, trial_path, plan_path, err_path, plan_err_path, plan_rc, expect, expect_error = sys.argv[1:]
def load(path):
    try:
        text = open(path).read().strip().splitlines()
        return json.loads(text[-1]) if text else None
    except (OSError, ValueError):
        return None
def last_line(path):
    try:
        return (open(path).read().strip().splitlines() or ["no output"])[-1]
    except OSError:
        return "no output"
if plan_rc != "0":  # the space does not load (or plan broke): no trial was run
    print(f"{name}\tfailed:plan\t-\t-\t-\t-\t-\t-\tplan exited {plan_rc}: {last_line(plan_err_path)[:140]}")
    sys.exit()
trial, plan = load(trial_path), load(plan_path) or []
# The prediction split as the trial measures it: torch's reserved peak, and the device memory outside torch.
entry = next((e["predicted"] for e in plan if e.get("valid")), None)
outside_pred = entry["memory_breakdown_gib"]["non_torch"] if entry else None
predicted = entry["memory_gib"] - outside_pred if entry else None
if trial is None:
    shown = f"{predicted:.2f}" if predicted is not None else "-"
    print(f"{name}\tfailed\t-\t-\t-\t{shown}\t-\t-\tno trial JSON: {last_line(err_path)[:100]}")
    sys.exit()
m = trial.get("metrics") or {}
status = trial["status"] if trial["status"] != "failed" else f"failed:{trial.get('failure_kind')}"
if expect and status != "planned":  # EXPECT: the outcomes this case is there to show
    met = expect == "any" or (status in expect.split() and expect_error in (trial.get("error") or ""))
    if not met:
        status = f"failed:unexpected:{status}"
    elif status != "passed":
        status = f"{'diagnosis' if expect == 'any' else 'as-expected'}:{status}"
tps = f"{m['tokens_per_s']:.0f}" if m.get("tokens_per_s") else "-"
peak = f"{m['peak_memory_gib']:.2f}" if m.get("peak_memory_gib") else "-"
pre = f"{m['pre_steps_peak_memory_gib']:.2f}" if m.get("pre_steps_peak_memory_gib") else "-"
pred = f"{predicted:.2f}" if predicted is not None else "invalid: " + "; ".join(
    (plan[0]["reasons"] if plan else ["no layout matched"]))[:80]
outside = f"{m['non_torch_memory_gib']:.2f}" if m.get("non_torch_memory_gib") is not None else "-"
outside += f" / {outside_pred:.2f}" if outside_pred is not None else ""
ckpt = f"{m['checkpoint_peak_memory_gib']:.2f}" if m.get("checkpoint_peak_memory_gib") else "-"
notes = "; ".join(trial.get("notes") or [])
if trial.get("error"):
    notes = (trial["error"] + ("; " + notes if notes else ""))
print(f"{name}\t{status}\t{tps}\t{peak}\t{pre}\t{pred}\t{outside}\t{ckpt}\t{notes[:160]}")
EOF
}

# -- the cases ---------------------------------------------------------------------------------------------------------
# bf16-dense is issue 44's too: its fresh rank actors are what the warm-rank cases compare with, and its BF16
# reference (sweeps/gpu-check-bf16-dense) is the one the [bf16, fp8] space's FP8 trial is gated against.
GROUP="issue30 issue44" run_case bf16-dense "$DENSE" bf16 "gpus=1,tp=1,sp=false,precision=bf16"
if cc_at_least 8 9; then
    run_case fp8-dense "$DENSE" fp8 "gpus=1,tp=1,sp=false,precision=fp8"
    # Blockwise (1x128/128x128) scaling is native on Hopper and needs CUDA >= 12.9 in TE; checked there only.
    if [[ ${CC%%.*} == 9 && $CUDA_OK == yes ]]; then
        run_case fp8-blockwise "$DENSE" fp8 "gpus=1,tp=1,sp=false,precision=fp8" 1 "{fp8_recipe: blockwise}"
    else
        skip fp8-blockwise "blockwise FP8 is checked on Hopper (9.x) with CUDA >= 12.9 only (this GPU: $CC)"
    fi
else
    skip fp8-dense "FP8 needs compute capability >= 8.9 (this GPU: $CC)"
fi
if [[ ${CC%%.*} == 10 ]]; then
    run_case mxfp8-dense "$DENSE" mxfp8 "gpus=1,tp=1,sp=false,precision=mxfp8"
else
    skip mxfp8-dense "MXFP8 needs compute capability 10.x (this GPU: $CC)"
fi
# A local CUDA graph (per layer; megatron-core's schedules capture it), at the gate's micro-batch and another one:
# issue 44's items 2 (NCCL_GRAPH_REGISTER=0 below compute capability 10) and 3 (graphs recorded on the gate's shape).
GRAPH_AXES=", mbs: [1, 2], cuda_graph: [local]"
run_case bf16-graph-mbs1 "$DENSE" bf16 "gpus=1,tp=1,sp=false,mbs=1,precision=bf16,cuda_graph=local" 1 "" "$GRAPH_AXES"
GROUP="issue30 issue44" run_case bf16-graph-mbs2 "$DENSE" bf16 \
    "gpus=1,tp=1,sp=false,mbs=2,precision=bf16,cuda_graph=local" 1 "" "$GRAPH_AXES"
if [[ $NGPU -ge 2 ]]; then
    run_case bf16-overlap-dp2 "$DENSE" bf16 "gpus=2,tp=1,sp=false,precision=bf16,distributed_optimizer=true" 2 \
        "{framework: megatron-bridge}"
else
    run_case bf16-overlap-dp1 "$DENSE" bf16 "gpus=1,tp=1,sp=false,precision=bf16,distributed_optimizer=true" 1 \
        "{framework: megatron-bridge}"
fi
if [[ $HAS_BRIDGE == yes ]]; then
    HF="$WORK/hf-llama"
    mkdir -p "$HF"
    printf '%s\n' '{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 1024,' \
        '"intermediate_size": 2816, "num_attention_heads": 16, "num_key_value_heads": 4, "num_hidden_layers": 4,' \
        '"vocab_size": 32000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,' \
        '"hidden_act": "silu", "tie_word_embeddings": false, "torch_dtype": "bfloat16"}' >"$HF/config.json"
    run_case bf16-bridge-llama "{hf: $HF}" bf16 "gpus=1,tp=1,sp=false,precision=bf16"
else
    skip bf16-bridge-llama "Megatron-Bridge not installed (pip install -e '.[bridge]')"
fi
run_case bf16-moe "$MOE" bf16 "gpus=1,tp=1,sp=false,precision=bf16"
run_case bf16-mla "$MLA" bf16 "gpus=1,tp=1,sp=false,precision=bf16"
if [[ $NGPU -ge 2 ]]; then
    GROUP="issue30 issue44" run_case bf16-dense-tp2-sp "$DENSE" bf16 "gpus=2,tp=2,sp=true,precision=bf16" 2
else
    skip bf16-dense-tp2-sp "sequence parallel needs TP>1: one GPU visible (the TP1 runs above cover the rest)"
fi
# Both 1B cases are one space (SPACE): the second reuses the first's reference.
for mbs in 1 2; do
    SPACE=dense-1b TRAINING=$TRAINING_1B run_case "bf16-dense-1b-mbs$mbs" "$DENSE_1B" bf16 \
        "gpus=1,tp=1,sp=false,mbs=$mbs,precision=bf16" 1 "" ", mbs: [1, 2]"
done
if [[ $HAS_MAMBA == yes ]]; then
    run_case bf16-hybrid "$HYBRID" bf16 "gpus=1,tp=1,sp=false,precision=bf16"
else
    skip bf16-hybrid "mamba_ssm not installed (pip install mamba-ssm causal-conv1d)"
fi

# -- issue 44: each item on a GPU (besides bf16-dense, bf16-graph-mbs2 and bf16-dense-tp2-sp above) ------------------
GROUP=issue44
# Local graphs on a dropless MoE model (item 4): rules.local_graphs_dropless_moe refuses it before launch (pruned,
# with its reason); were the rule dropped, the trial would show whether the capture holds the token dispatch.
run_case bf16-moe-graph-local "$MOE" bf16 "gpus=1,tp=1,sp=false,mbs=1,precision=bf16,cuda_graph=local" 1 "" \
    ", cuda_graph: [local]"
if [[ $NGPU -ge 2 ]]; then
    # The combined 1F1B schedule asks the forward step for the model's schedule plan (item 1).
    EP=2 run_case bf16-moe-a2a-ep2 "$MOE" bf16 "gpus=2,tp=1,sp=false,ep=2,precision=bf16,moe_a2a_overlap=true" 2 "" \
        ", moe_a2a_overlap: [true]"
else
    skip bf16-moe-a2a-ep2 "moe_a2a_overlap needs EP>1: one GPU visible"
fi
if cc_at_least 8 9; then
    # FP8 in a [bf16, fp8] space: gated against the space's reference, made in its first precision (item 5); the
    # space shares bf16-dense's name, so its BF16 reference is reused.
    SPACE=bf16-dense run_case fp8-dense-bf16-ref "$DENSE" "bf16, fp8" "gpus=1,tp=1,sp=false,precision=fp8"
    # Megatron-Bridge's FP8: FP8 parameters (its recipes' default; they need the distributed optimizer), its
    # fusions (item 8), and the checkpoint's bitwise round trip of FP8 weights and TE's extra state (item 14).
    run_case fp8-bridge-params "$DENSE" fp8 "gpus=1,tp=1,sp=false,precision=fp8,distributed_optimizer=true" 1 \
        "{framework: megatron-bridge}"
else
    skip fp8-dense-bf16-ref "FP8 needs compute capability >= 8.9 (this GPU: $CC)"
    skip fp8-bridge-params "FP8 needs compute capability >= 8.9 (this GPU: $CC)"
fi
if [[ ${CC%%.*} == 10 ]]; then
    # MXFP8 weights gathered through the grad buffer, refilled after each zeroing (item 10).
    run_case mxfp8-fp8-params "$DENSE" mxfp8 "gpus=1,tp=1,sp=false,precision=mxfp8,distributed_optimizer=true" 1 \
        "{fp8_param_gather: true}"
else
    skip mxfp8-fp8-params "MXFP8 needs compute capability 10.x (this GPU: $CC)"
fi
# A declared capability that is not the card's (item 6): every rank fails the trial with one line, infra.
if [[ $CC == 9.0 ]]; then WRONG_CC=10.0; else WRONG_CC=9.0; fi
CC_DECLARED=$WRONG_CC EXPECT=failed:infra EXPECT_ERROR="cluster.compute_capability is $WRONG_CC but" \
    run_case bf16-cc-mismatch "$DENSE" bf16 "gpus=1,tp=1,sp=false,precision=bf16"
# Warm forked ranks (item 16) beside bf16-dense's fresh rank actors: the child keeps the driver's /dev/nvidia*
# descriptors; SWEEPER_FORK_CLOSE_DEVICE_FILES=1 (trial/forked.py, read from the warm rank's environment, which Ray
# started from this one) closes them as the first GPU run's forked ranks did, where NCCL's nvmlInit failed. That one
# is a diagnosis: whatever it finds is shown, not counted as a failure.
SPACE=bf16-dense GPU_CHECK_WARM_RANKS=true run_case bf16-dense-warm "$DENSE" bf16 "gpus=1,tp=1,sp=false,precision=bf16"
SPACE=bf16-dense GPU_CHECK_WARM_RANKS=true SWEEPER_FORK_CLOSE_DEVICE_FILES=1 EXPECT=any \
    run_case bf16-dense-warm-closefds "$DENSE" bf16 "gpus=1,tp=1,sp=false,precision=bf16"

# -- the table ---------------------------------------------------------------------------------------------------------
echo
{
    printf 'case\tstatus\ttokens/s\treserved peak GiB\tbefore the steps GiB\tpredicted\toutside torch GiB / predicted'
    printf '\tcheckpoint GiB\tnotes\n'
    cat "$ROWS"
} | if command -v column >/dev/null; then column -t -s $'\t'; else cat; fi
FAILED=$(awk -F'\t' '$2 ~ /^failed/ && $2 != "failed:unsupported"' "$ROWS" | wc -l)
echo
echo "$FAILED case(s) ran and failed; logs: rank_*.log under each trial folder (SWEEPER_GPU_CHECK_KEEP=1 keeps them)"
[[ $FAILED -eq 0 ]]
