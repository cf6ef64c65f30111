"""``launch_megatron_lm.sh``: the winner as a Megatron-LM run a user can start (torchrun, or srun + torchrun).

The flags are Megatron-LM's own (``megatron/training/arguments.py`` at the tag of the installed megatron-core;
``tests/data/megatron_lm_flags.txt`` lists them, and the tests check every flag written here against it):
  - the model: every architecture field of the ModelSpec, in the names ``pretrain_gpt.py`` (``pretrain_mamba.py``
    for hybrid Mamba models) reads;
  - the layout, precision and recompute flags (``Layout.megatron_args``), the run settings that move memory
    (``RunSettings.megatron_args``) and the run's framework's kernel fusions where Megatron-LM's defaults differ
    (``sweeper.config.fusions``), exactly as in best_layout.yaml;
  - the training shape the sweep measured (sequence length, global batch) and the MoE router settings of the
    smoke run.
What the sweep did not decide (data, tokenizer, learning rate schedule, iterations, checkpoint folder) is an
environment variable with a placeholder default, named at the top of the script.
"""

from __future__ import annotations

import shlex

from sweeper.config import fusions, megatron_release
from sweeper.config.run_settings import MOE_AUX_LOSS_COEFF, MOE_LOAD_BALANCING_TYPE
from sweeper.config.schema import SweepConfig
from sweeper.export.production import measured_note
from sweeper.models.spec import DEEPSEEK_YARN, ModelSpec
from sweeper.space.environment import megatron_environment
from sweeper.space.layout import Layout

LAUNCH_FILE = "launch_megatron_lm.sh"


def model_args(spec: ModelSpec, seq_length: int) -> list[str]:
    """Megatron-LM's architecture flags for ``spec`` trained at ``seq_length``."""
    args = [
        f"--num-layers={spec.num_layers}", f"--hidden-size={spec.hidden_size}",
        f"--ffn-hidden-size={spec.ffn_hidden_size}", f"--num-attention-heads={spec.num_attention_heads}",
        f"--seq-length={seq_length}", f"--max-position-embeddings={max(spec.max_position_embeddings, seq_length)}",
        f"--normalization={spec.normalization}", f"--position-embedding-type={spec.position_embedding_type}",
    ]
    if spec.query_groups != spec.num_attention_heads:
        args += ["--group-query-attention", f"--num-query-groups={spec.query_groups}"]
    if spec.kv_channels is not None:
        args.append(f"--kv-channels={spec.kv_channels}")
    if spec.untie_embeddings_and_output_weights:
        args.append("--untie-embeddings-and-output-weights")
    if spec.gated_linear_unit:
        args.append("--swiglu")
    elif spec.is_hybrid:
        args.append("--squared-relu")  # Nemotron-H's relu2 MLPs (the smoke run's MambaModel builder does the same)
    if not spec.add_bias_linear:
        args.append("--disable-bias-linear")
    if spec.add_qkv_bias:
        args.append("--add-qkv-bias")
    if spec.qk_layernorm:
        args.append("--qk-layernorm")
    if spec.is_moe:
        args += _moe_args(spec)
    if spec.multi_latent_attention:
        args += _mla_args(spec)
    if spec.mtp_num_layers:
        args.append(f"--mtp-num-layers={spec.mtp_num_layers}")
    if spec.is_hybrid:
        args += [
            "--is-hybrid-model", f"{megatron_release.hybrid_pattern_flag()}={spec.hybrid_layer_pattern}",
            f"--mamba-num-heads={spec.mamba_heads}", f"--mamba-head-dim={spec.mamba_head_dim}",
            f"--mamba-num-groups={spec.mamba_num_groups}", f"--mamba-state-dim={spec.mamba_state_dim}",
        ]
    return args


def _moe_args(spec: ModelSpec) -> list[str]:
    dense = spec.moe_first_k_dense
    args = [
        f"--num-experts={spec.num_moe_experts}", f"--moe-router-topk={spec.moe_router_topk}",
        f"--moe-ffn-hidden-size={spec.expert_ffn_hidden_size}",
        f"--moe-router-load-balancing-type={MOE_LOAD_BALANCING_TYPE}", f"--moe-aux-loss-coeff={MOE_AUX_LOSS_COEFF}",
        "--moe-token-dispatcher-type=alltoall", "--moe-grouped-gemm",
    ]
    if dense and not spec.is_hybrid:  # a hybrid pattern places its MoE layers itself
        args.append(f"--moe-layer-freq=([0]*{dense}+[1]*{spec.num_layers - dense})")
    if spec.moe_shared_expert_intermediate_size is not None:
        args.append(f"--moe-shared-expert-intermediate-size={spec.moe_shared_expert_intermediate_size}")
    if spec.moe_router_pre_softmax:
        args.append("--moe-router-pre-softmax")
    if spec.moe_router_num_groups is not None:
        args.append(f"--moe-router-num-groups={spec.moe_router_num_groups}")
    return args


def _mla_args(spec: ModelSpec) -> list[str]:
    args = ["--multi-latent-attention", f"--kv-lora-rank={spec.kv_lora_rank}", f"--qk-head-dim={spec.qk_head_dim}",
            f"--qk-pos-emb-head-dim={spec.qk_pos_emb_head_dim}", f"--v-head-dim={spec.v_head_dim}"]
    if spec.q_lora_rank is not None:
        args.append(f"--q-lora-rank={spec.q_lora_rank}")
    # Megatron-LM has flags for these YaRN fields; beta_fast / beta_slow / original_max_position_embeddings keep
    # MLATransformerConfig's defaults, which are DeepSeek's values.
    for field in ("rope_type", "rotary_base", "rotary_scaling_factor", "mscale", "mscale_all_dim"):
        args.append(f"--{field.replace('_', '-')}={DEEPSEEK_YARN[field]}")
    return args


def layout_args(cfg: SweepConfig, layout: Layout) -> list[str]:
    """The layout's flags, the run settings' and the framework's fusions where they differ from Megatron-LM's
    (best_layout.yaml ``megatron_args``)."""
    return layout.megatron_args(megatron_release.graph_modules()) + cfg.run.megatron_args(
        layout.precision, cfg.cluster.compute_capability, distributed_optimizer=layout.distributed_optimizer,
        fsdp=bool(layout.fsdp),
    ) + fusions.megatron_lm_args(fusions.framework_fusions(cfg.run.framework, cfg.model), cfg.model)


def node_shape(world_size: int, gpus_per_node: int) -> tuple[int, int]:
    """(nodes, GPUs per node) of a torchrun launch of ``world_size`` ranks: the fewest nodes that hold them with the
    same number on each (torchrun's --nproc-per-node is one number): 12 GPUs on 8-GPU nodes run as 2 x 6."""
    least = -(-world_size // gpus_per_node)
    nodes = next(n for n in range(least, world_size + 1) if world_size % n == 0)
    return nodes, world_size // nodes


def launch_script(cfg: SweepConfig, layout: Layout, trial: int, measured: Layout | None = None) -> str:
    """The bash script (see the module docstring) for ``layout``; ``measured``: the trial's layout it is the
    production shape of (named in the header)."""
    nodes, per_node = node_shape(layout.world_size, cfg.cluster.gpus_per_node)
    release = megatron_release.installed()
    entry = "pretrain_mamba.py" if cfg.model.is_hybrid else "pretrain_gpt.py"
    # The trial's ranks ran with the same variables (sweeper.space.environment, trial/runner.py).
    variables = megatron_environment(layout, cfg.cluster.compute_capability)
    env = [f"export {v.name}={v.value}  # {v.why}" for v in variables]
    if not any(v.name == "CUDA_DEVICE_MAX_CONNECTIONS" for v in variables):
        env.insert(0, "# CUDA_DEVICE_MAX_CONNECTIONS is left unset: Megatron-LM asks for 1 only with TP or CP > 1 "
                      "before Blackwell, and not with the expert A2A overlap or Megatron-FSDP")
    spec = ["--spec", "megatron.core.models.mamba.mamba_layer_specs", "mamba_stack_spec"] if cfg.model.is_hybrid \
        else []
    vocab = cfg.model.vocab_size
    lines = [
        "#!/usr/bin/env bash",
        f"# {cfg.name}: the layout sweeper found best (trial #{trial}, {layout.short()}) for {cfg.model.name},",
        f"# on {nodes} node(s) x {per_node} GPUs (compute capability {cfg.cluster.compute_capability}).",
        *measured_note(layout, measured or layout),
        "# Written by sweeper next to best_layout.yaml; the layout, precision and recompute flags are the ones the",
        "# sweep measured. Run it from any folder, one copy per node:",
        "#   MEGATRON_LM=/path/to/Megatron-LM bash launch_megatron_lm.sh                      (one node)",
        "#   srun --nodes=N --ntasks-per-node=1 env MEGATRON_LM=... bash launch_megatron_lm.sh (Slurm)",
        "# Set what the sweep did not decide: DATA_ARGS (default: Megatron-LM's mock data and NullTokenizer),",
        "# TRAIN_ITERS, LR, MIN_LR, WARMUP_ITERS, CHECKPOINT_DIR.",
        "set -euo pipefail",
        f': "${{MEGATRON_LM:?set MEGATRON_LM to a Megatron-LM checkout matching megatron-core {release}, as the '
        'sweep ran}}"',
        "",
        *env,
        "",
        f"GPUS_PER_NODE={per_node}",
        f"NNODES=${{NNODES:-${{SLURM_NNODES:-{nodes}}}}}",
        "NODE_RANK=${NODE_RANK:-${SLURM_NODEID:-0}}",
        'if [[ -z "${MASTER_ADDR:-}" && -n "${SLURM_JOB_NODELIST:-}" ]]; then',
        '  MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "fi",
        "MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}",
        "MASTER_PORT=${MASTER_PORT:-6000}",
        f"if [[ $NNODES -ne {nodes} ]]; then echo \"this layout needs {nodes} node(s), NNODES is $NNODES\" >&2; "
        "exit 2; fi",
        "",
        _array("MODEL_ARGS", [a for a in model_args(cfg.model, cfg.training.seq_length) + spec
                              if not (layout.moe_token_dispatcher and a.startswith("--moe-token-dispatcher-type="))]),
        _array("LAYOUT_ARGS", layout_args(cfg, layout)),
        _array("TRAINING_ARGS", [
            "--train-iters=${TRAIN_ITERS:-100000}", "--lr=${LR:-3e-4}", "--min-lr=${MIN_LR:-3e-5}",
            "--lr-decay-style=cosine", "--lr-warmup-iters=${WARMUP_ITERS:-2000}", "--weight-decay=0.1",
            "--clip-grad=1.0", "--adam-beta1=0.9", "--adam-beta2=0.95", "--init-method-std=0.02",
            "--attention-dropout=0.0", "--hidden-dropout=0.0",
            "--log-interval=10", "--log-throughput", "--eval-iters=0",
            "--save=${CHECKPOINT_DIR:-checkpoints}", "--load=${CHECKPOINT_DIR:-checkpoints}", "--save-interval=1000",
        ], quote=False),
        f'read -r -a DATA_ARGS <<< "${{DATA_ARGS:---mock-data --tokenizer-type=NullTokenizer --vocab-size={vocab}}}"',
        "",
        'exec torchrun --nproc-per-node="$GPUS_PER_NODE" --nnodes="$NNODES" --node-rank="$NODE_RANK" \\',
        '  --master-addr="$MASTER_ADDR" --master-port="$MASTER_PORT" \\',
        f'  "$MEGATRON_LM/{entry}" "${{MODEL_ARGS[@]}}" "${{LAYOUT_ARGS[@]}}" "${{TRAINING_ARGS[@]}}" '
        '"${DATA_ARGS[@]}"',
        "",
    ]
    return "\n".join(lines)


def _array(name: str, items: list[str], quote: bool = True) -> str:
    """A bash array, one item per line (``quote`` off: items expand ``${VAR:-default}``)."""
    body = "".join(f"  {shlex.quote(item) if quote else _double(item)}\n" for item in items)
    return f"{name}=(\n{body})"


def _double(item: str) -> str:
    return f'"{item}"'
