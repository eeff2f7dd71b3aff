//! The model families, in one list: what the engine, the planner and the chain ask of a
//! family, found by the file's architecture name. Adding a family means one entry here
//! (llama.cpp keeps the same kind of table in `llama-arch.cpp`).

use super::runtime::link;
use super::{deepseek4, gemma4, llama, qwen35, step37, ModelFile};
use crate::forward::LoadOptions;
use crate::gpu::{AutoProducts, Gpu};
use crate::model_file::PartSpec;
use crate::moe::{EachExpert, ExpertNames, FusedStacks, Needs, RunShape};
use crate::{Error, Result};
use std::sync::Arc;

/// A family's loader: the layers of `opts.part` (the whole model without it) onto a device.
pub type LoadFn = fn(Arc<Gpu>, &ModelFile, &LoadOptions) -> Result<Box<dyn link::Part>>;

/// What a draft block `opts` loads beside the model in the file needs for a run.
pub type DraftNeedsFn = fn(&ModelFile, &LoadOptions, RunShape) -> Result<Needs>;

/// One family: its architecture names and the functions that read its files.
pub struct Family {
    /// For messages.
    pub name: &'static str,
    /// GGUF `general.architecture` values and HF `architectures` entries.
    pub archs: &'static [&'static str],
    pub load: LoadFn,
    /// Blocks of the trunk (what a chain splits).
    pub n_layer: fn(&ModelFile) -> Result<usize>,
    /// What the layers of `part` need beside their weights (the loader budgets with it).
    pub needs_part: fn(&ModelFile, RunShape, &PartSpec) -> Result<Needs>,
    /// What `--matmul auto` may run the model with.
    pub products: fn(&ModelFile) -> Result<AutoProducts>,
    /// Rows of one prefill pass the loader sizes its activations for.
    pub pass_rows: usize,
    /// Where its files keep the routed experts (the planner and the expert arena read them).
    pub experts: &'static ExpertNames,
    /// Its multi-token prediction block ships in a separate GGUF (`--mtp-model`), as
    /// Step-3.5/3.7's does; other families carry theirs in the trunk's file or have none.
    pub mtp_file: bool,
    /// What a draft block loaded beside the trunk (`--mtp-model`) needs on top of
    /// `needs_part`: its weights, KV and rows; `None` where the family has no such block.
    pub draft_needs: Option<DraftNeedsFn>,
}

/// llama.cpp's GGUF expert stacks (`LLM_TENSOR_FFN_{GATE,UP,DOWN}_EXPS` in `llama-arch.cpp`),
/// the same for every family.
const GGUF_STACKS: [&str; 3] = [
    "blk.{l}.ffn_gate_exps.weight",
    "blk.{l}.ffn_up_exps.weight",
    "blk.{l}.ffn_down_exps.weight",
];

/// Step-3.5/3.7's checkpoints keep stacks `[n_expert, rows, cols]` as GGUF does (the
/// release's `moe.{gate,up,down}_proj.weight`; `step37::W::hf_name`).
const STEP37_HF_STACKS: [&str; 3] = [
    "model.layers.{l}.moe.gate_proj.weight",
    "model.layers.{l}.moe.up_proj.weight",
    "model.layers.{l}.moe.down_proj.weight",
];

/// Hugging Face checkpoints with one tensor per expert (`mlp.experts.E.{gate,up,down}_proj`),
/// as Qwen3-MoE's and Qwen3.5's.
const HF_EXPERTS: EachExpert = EachExpert {
    names: [
        "model.layers.{l}.mlp.experts.{e}.gate_proj.weight",
        "model.layers.{l}.mlp.experts.{e}.up_proj.weight",
        "model.layers.{l}.mlp.experts.{e}.down_proj.weight",
    ],
    packed: false,
};

/// DeepSeek's release names (`w1` gate, `w3` up, `w2` down, as the `Expert` of DeepSeek-V3's
/// `inference/model.py`); DeepSeek-V4's I8/U8 experts are e2m1 pairs.
const DEEPSEEK_EXPERTS: EachExpert = EachExpert {
    names: [
        "layers.{l}.ffn.experts.{e}.w1.weight",
        "layers.{l}.ffn.experts.{e}.w3.weight",
        "layers.{l}.ffn.experts.{e}.w2.weight",
    ],
    packed: true,
};

/// Gemma-4's fused gate+up stacks: llama.cpp's converter writes `ffn_gate_up_exps`
/// (`LLM_TENSOR_FFN_GATE_UP_EXPS`) beside the usual down stack; transformers'
/// `Gemma4TextExperts` keeps `gate_up_proj` `[E, 2·F, H]` and `down_proj` `[E, H, F]`.
const GEMMA4_FUSED: [FusedStacks; 2] = [
    FusedStacks {
        gate_up: "blk.{l}.ffn_gate_up_exps.weight",
        down: "blk.{l}.ffn_down_exps.weight",
    },
    FusedStacks {
        gate_up: "model.layers.{l}.experts.gate_up_proj",
        down: "model.layers.{l}.experts.down_proj",
    },
];

static QWEN_EXPERT_NAMES: ExpertNames = ExpertNames {
    stacks: &[GGUF_STACKS],
    fused: &[],
    each: &[HF_EXPERTS],
    host: &[],
};

static DEEPSEEK_EXPERT_NAMES: ExpertNames = ExpertNames {
    stacks: &[GGUF_STACKS],
    fused: &[],
    each: &[DEEPSEEK_EXPERTS],
    host: &[],
};

/// Gemma-4's per-layer token table (E2B/E4B), read on the host per pass (`gemma4::W::
/// PerLayerTokEmbd`'s GGUF and checkpoint names).
const GEMMA4_HOST: [&str; 2] = [
    "per_layer_token_embd.weight",
    "model.embed_tokens_per_layer.weight",
];

/// Gemma-4: fused stacks (GGUF files may also carry separate gate and up stacks).
static GEMMA4_EXPERT_NAMES: ExpertNames = ExpertNames {
    stacks: &[GGUF_STACKS],
    fused: &GEMMA4_FUSED,
    each: &[],
    host: &GEMMA4_HOST,
};

/// Step-3.7: GGUF stacks; its checkpoints stack the experts too (`moe.gate_proj.weight
/// [E, I, H]`), which the planner does not see as experts (one stack naming here), so they
/// load whole.
static STEP37_EXPERT_NAMES: ExpertNames = ExpertNames {
    stacks: &[GGUF_STACKS, STEP37_HF_STACKS],
    fused: &[],
    each: &[],
    host: &[],
};

/// A file of no known family (`lathe plan` still sizes it): every naming above.
static ANY_EXPERT_NAMES: ExpertNames = ExpertNames {
    stacks: &[GGUF_STACKS, STEP37_HF_STACKS],
    fused: &GEMMA4_FUSED,
    each: &[HF_EXPERTS, DEEPSEEK_EXPERTS],
    host: &[],
};

/// Every family lathe runs.
pub static FAMILIES: &[Family] = &[
    Family {
        name: "Qwen3.5",
        archs: &[
            "qwen35",
            "qwen35moe",
            "qwen3next",
            "Qwen3_5ForCausalLM",
            "Qwen3_5MoeForCausalLM",
            "Qwen3NextForCausalLM",
            "Qwen3_5ForConditionalGeneration",
            "Qwen3_5MoeForConditionalGeneration",
        ],
        load: |gpu, f, o| Ok(Box::new(qwen35::gpu::GpuModel::load(gpu, f, o)?)),
        n_layer: |f| Ok(qwen35::Hparams::from_file(f)?.n_layer),
        needs_part: |f, run, part| {
            Ok(qwen35::gpu::needs_part(
                &qwen35::Hparams::from_file(f)?,
                run,
                part,
            ))
        },
        // Router top-k on computed values: f32-level products (see `super::auto_products`).
        products: |f| {
            Ok(if qwen35::Hparams::from_file(f)?.moe.is_some() {
                AutoProducts::F32
            } else {
                AutoProducts::Any
            })
        },
        pass_rows: qwen35::gpu::DEFAULT_BATCH,
        experts: &QWEN_EXPERT_NAMES,
        mtp_file: false,
        draft_needs: None,
    },
    Family {
        name: "DeepSeek-V4",
        archs: &["deepseek4", "DeepseekV4ForCausalLM"],
        load: |gpu, f, o| Ok(Box::new(deepseek4::gpu::GpuModel::load(gpu, f, o)?)),
        n_layer: |f| Ok(deepseek4::Hparams::from_file(f)?.n_layer),
        needs_part: |f, run, part| {
            Ok(deepseek4::gpu::needs_part(
                &deepseek4::Hparams::from_file(f)?,
                run,
                part,
            ))
        },
        // The indexer's and router's top-k hold the fixtures only at f32 level.
        products: |f| deepseek4::Hparams::from_file(f).map(|_| AutoProducts::F32),
        pass_rows: deepseek4::gpu::DEFAULT_BATCH,
        experts: &DEEPSEEK_EXPERT_NAMES,
        mtp_file: false,
        draft_needs: None,
    },
    Family {
        name: "Llama",
        archs: llama::ARCHS,
        load: |gpu, f, o| Ok(Box::new(llama::gpu::GpuModel::load(gpu, f, o)?)),
        n_layer: |f| Ok(llama::Hparams::from_file(f)?.n_layer),
        needs_part: |f, run, part| {
            Ok(llama::gpu::needs_part(
                &llama::Hparams::from_file(f)?,
                run,
                part,
            ))
        },
        // Router top-k on computed values: f32-level products, as Qwen3.5's MoE.
        products: |f| {
            Ok(if llama::Hparams::from_file(f)?.moe.is_some() {
                AutoProducts::F32
            } else {
                AutoProducts::Any
            })
        },
        pass_rows: llama::gpu::DEFAULT_BATCH,
        experts: &QWEN_EXPERT_NAMES,
        mtp_file: false,
        draft_needs: None,
    },
    Family {
        name: "Gemma-4",
        archs: gemma4::ARCHS,
        load: |gpu, f, o| Ok(Box::new(gemma4::gpu::GpuModel::load(gpu, f, o)?)),
        n_layer: |f| Ok(gemma4::Hparams::from_file(f)?.n_layer),
        needs_part: |f, run, part| {
            Ok(gemma4::gpu::needs_part(
                &gemma4::Hparams::from_file(f)?,
                run,
                part,
            ))
        },
        products: |f| {
            Ok(if gemma4::Hparams::from_file(f)?.moe.is_some() {
                AutoProducts::F32
            } else {
                AutoProducts::Any
            })
        },
        pass_rows: gemma4::gpu::DEFAULT_BATCH,
        experts: &GEMMA4_EXPERT_NAMES,
        mtp_file: false,
        draft_needs: None,
    },
    Family {
        name: "Step-3.7",
        archs: step37::ARCHS,
        load: |gpu, f, o| Ok(Box::new(step37::gpu::GpuModel::load(gpu, f, o)?)),
        n_layer: |f| Ok(step37::Hparams::from_file(f)?.n_layer),
        needs_part: |f, run, part| {
            Ok(step37::gpu::needs_part(
                &step37::Hparams::from_file(f)?,
                run,
                part,
            ))
        },
        // Router top-k on computed values: f32-level products, as the other MoE families.
        products: |f| {
            Ok(if step37::Hparams::from_file(f)?.moe.is_some() {
                AutoProducts::F32
            } else {
                AutoProducts::Any
            })
        },
        pass_rows: step37::gpu::DEFAULT_BATCH,
        experts: &STEP37_EXPERT_NAMES,
        mtp_file: true,
        draft_needs: Some(step37::gpu::draft_needs),
    },
];

/// The family whose architecture names hold `file`'s architecture.
pub fn family_of(file: &ModelFile) -> Option<&'static Family> {
    let arch = file.architecture().ok()?;
    FAMILIES.iter().find(|f| f.archs.contains(&arch.as_str()))
}

/// [`family_of`], or an error naming the file and its architecture.
pub fn family(file: &ModelFile) -> Result<&'static Family> {
    family_of(file).ok_or_else(|| match file.architecture() {
        Ok(arch) => Error::Unsupported(format!("{}: architecture {arch}", file.path().display())),
        Err(e) => e,
    })
}

/// Where `file`'s family keeps its routed experts; every known naming for a file of no
/// known family.
pub fn expert_names(file: &ModelFile) -> &'static ExpertNames {
    family_of(file).map_or(&ANY_EXPERT_NAMES, |f| f.experts)
}

/// Rows of one pass for a file of no known family (the planner still sizes a run for it):
/// 512 as llama.cpp's micro-batch, as every family's.
pub const DEFAULT_PASS_ROWS: usize = 512;
