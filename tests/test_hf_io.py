"""Pretrained Hugging Face folders in, fine-tuned under parallel layouts, exported back.

A small random model of each family (gpt2, qwen2, and llama: the example's sharded folder) is saved with
`save_pretrained` (no network), fine-tuned on prompt/response pairs (loss on the response only) with a BPE
tokenizer trained on the embedded corpus, under a parallel layout (each family once in 3D, dp2 x tp2 x pp2,
under another zero level each) and on one process. Equivalence: losses within 1e-5 relative and exported
weights within 5e-5 absolute of the single-process run (AdamW divides each update by the gradient's
own scale, so an element whose gradient is near zero can move by a fraction of lr = 1e-3 differently
when the layout reorders float sums; the losses are the tight check). Round trip: `from_pretrained` of
the export gives the logits of autopar's final model (one process: same weights, same code, 1e-6
absolute; a parallel run's export: 1e-4 relative of the one-process export, so of autopar's final model).
Each rank reads only its part of the weights. examples/finetune_hf.py itself runs llama under tp2.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from example_runner import run_example
from helpers import max_relative_difference

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
VOCAB = 320
FAMILIES = {
    "gpt2": dict(n_layer=2, n_embd=64, n_head=4, n_positions=128, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "llama": dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128),
    "qwen2": dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128),
    # MoE: save_pretrained stores one tensor per expert; the model holds them batched (gate_up_proj, down_proj)
    "mixtral": dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=128, num_local_experts=4, num_experts_per_tok=2),
}


def save_pretrained(family: str, folder: Path, max_shard_size: str = "5GB") -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.for_model(family, vocab_size=VOCAB, use_cache=False, pad_token_id=0, bos_token_id=1,
                                  eos_token_id=1, **FAMILIES[family])
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder, max_shard_size=max_shard_size)
    return folder


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """The example's inputs (a BPE tokenizer of 320 tokens, prompt/response pairs from the corpus)."""
    sys.path.insert(0, str(EXAMPLES))
    import finetune_hf
    workdir = tmp_path_factory.mktemp("inputs")
    llama, tokenizer, pairs = finetune_hf.make_inputs(workdir)  # llama: the example's sharded folder
    return {"tokenizer": str(tokenizer), "pairs": str(pairs), "cache": str(workdir / "cache"), "llama": llama}


def finetune(folder: str, inputs: dict, out: str, strategy: dict, micro_batch_size: int) -> dict:
    """Runs on every rank of a pool: fine-tune 2 steps, export; rank results for the test."""
    from autopar.config import DataConfig, JobConfig, ModelConfig, Strategy, TrainConfig
    from autopar.job import make_trainer
    job = JobConfig(model=ModelConfig(name=f"hf:{folder}"),
                    data=DataConfig(tokenizer=f"hf:{inputs['tokenizer']}", data=inputs["pairs"], seq_len=32,
                                    data_cache=inputs["cache"]),
                    strategy=Strategy(**strategy),
                    train=TrainConfig(steps=2, global_batch_size=8, micro_batch_size=micro_batch_size, lr=1e-3,
                                      warmup_steps=1, eval_batches=1, out=out, progress=False, timeout_s=60,
                                      export_hf=f"{out}/exported"))
    trainer = make_trainer(job)
    result = trainer.train()
    logits = None
    if torch.distributed.get_world_size() == 1:  # autopar's final model, whole: its logits on fixed tokens
        with torch.no_grad():
            trainer.model.eval()
            logits = trainer.model(probe_tokens()).logits
    return {"losses": result.losses, "eval_loss": result.eval_loss, "bytes_read": trainer.pretrained_bytes_read,
            "logits": logits, "kind": trainer.run_info["data_kind"]}


def probe_tokens() -> torch.Tensor:
    return torch.arange(2 * 24).reshape(2, 24) * 7 % VOCAB


def exported(out: Path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    folder = Path(out) / "exported"
    weights = {}
    for file in folder.glob("*.safetensors"):
        weights.update(load_file(str(file)))
    model = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    with torch.no_grad():
        return weights, model(probe_tokens()).logits


def tensor_bytes(folder: Path) -> int:
    from autopar.models.pretrained import SafetensorsFolder
    source = SafetensorsFolder(folder)
    return sum(source.read(n).numel() * 4 for n in source.names())


def assert_same_fine_tune(one: dict, many: list[dict], one_dir: Path, many_dir: Path, pretrained: Path) -> torch.Tensor:
    for got in many:
        assert max_relative_difference(one["losses"], got["losses"]) < 1e-5, (one["losses"], got["losses"])
        assert abs(one["eval_loss"] - got["eval_loss"]) / one["eval_loss"] < 1e-5
    ref_weights, ref_logits = exported(one_dir)
    weights, logits = exported(many_dir)
    assert weights.keys() == ref_weights.keys()
    for name, value in weights.items():
        assert (value - ref_weights[name]).abs().max() < 5e-5, name
    assert (logits - ref_logits).abs().max() < 1e-4 * ref_logits.abs().max()
    whole = tensor_bytes(pretrained)
    assert one["bytes_read"] == whole  # one process reads every tensor once (a tied weight once)
    for got in many:  # a stage, or a tensor-parallel slice, is less than the whole model
        assert got["bytes_read"] < 0.8 * whole, (got["bytes_read"], whole)
    return ref_logits


# (family, world, strategy, micro-batch size); under ZeRO-3 each rank reads only its dp rows of its stage. Each
# family is trained 3D (dp2 x tp2 x pp2) once, under another zero level each; tp2 alone is the example's test.
LAYOUTS = [("gpt2", 4, {"dp": 2, "pp": 2}, 2), ("gpt2", 2, {"zero": 3}, 4),
           ("gpt2", 8, {"dp": 2, "tp": 2, "pp": 2, "zero": 3}, 2),
           ("qwen2", 8, {"dp": 2, "tp": 2, "pp": 2, "zero": 2}, 2),
           ("llama", 8, {"dp": 2, "tp": 2, "pp": 2, "zero": 1}, 2),
           ("mixtral", 2, {"ep": 2}, 4)]  # each rank reads its 2 of the 4 experts stored one by one
_one_process: dict = {}  # family -> (pretrained folder, one-process result, its run folder): one run per family


def one_process(rank_pool, tmp_path_factory, inputs, family: str):
    """The family's pretrained folder (llama: the example's sharded one), its one-process fine-tune and run folder."""
    if family not in _one_process:
        base = tmp_path_factory.mktemp(f"one-{family}")
        folder = inputs["llama"] if family == "llama" else save_pretrained(family, base / "pretrained")
        _one_process[family] = folder, rank_pool(1).run(finetune, str(folder), inputs, str(base / "one"), {}, 8)[0], \
            base / "one"
    return _one_process[family]


@pytest.mark.parametrize("family,world,strategy,micro", LAYOUTS, ids=lambda v: str(v))
def test_finetune_layout_matches_one_process_and_exports(rank_pool, tmp_path, tmp_path_factory, inputs, family,
                                                         world, strategy, micro):
    folder, one, one_dir = one_process(rank_pool, tmp_path_factory, inputs, family)
    many = rank_pool(world).run(finetune, str(folder), inputs, str(tmp_path / "many"), strategy, micro)
    assert one["kind"] == "instruction"
    ref_logits = assert_same_fine_tune(one, many, one_dir, tmp_path / "many", folder)
    if family == "mixtral":  # exported as save_pretrained writes it: one tensor per expert, block_sparse_moe
        from autopar.models.pretrained import SafetensorsFolder
        assert exported(tmp_path / "many")[0].keys() == SafetensorsFolder(folder).names()
    # from_pretrained of the export runs autopar's final weights through the same HF code
    assert (ref_logits - one["logits"]).abs().max() < 1e-6
    # each rank reads its stage's tp slices (a quarter at tp2 x pp2: measured 0.25), under ZeRO-3 only its dp rows
    # of them (dp 2: half the model; 0.17 in 3D, not 0.125: norms and biases are whole in each tp slice)
    pp, tp, zero3 = strategy.get("pp", 1), strategy.get("tp", 1), strategy.get("zero") == 3
    share = {(1, 1, True): 0.55, (2, 2, True): 0.2, (2, 2, False): 0.3}.get((pp, tp, zero3))
    if strategy.get("ep"):  # half of the experts and every dense weight: measured 0.68 (its 51,616 of 76,192 params)
        share = 0.7
    if share is not None:
        whole = tensor_bytes(folder)
        assert all(got["bytes_read"] < share * whole for got in many), ([g["bytes_read"] for g in many], whole)


def test_export_command_line_writes_the_trained_weights_sharded(rank_pool, tmp_path, tmp_path_factory, inputs,
                                                                capsys):
    """`autopar export RUN --to hf OUT --max-shard-mb M` (no ranks) on the one-process gpt2 run: several shards and
    an index, the very tensors --export-hf wrote at the end of training (bitwise: the same checkpoint values), the
    tied head once, the run's tokenizer; from_pretrained gives autopar's final logits (1e-6, as above)."""
    from autopar.cli import build_parser, cmd_export
    from autopar.errors import ConfigError
    from autopar.models.pretrained import INDEX_FILE
    from autopar.train.hf_export import export_hf
    _, one, one_dir = one_process(rank_pool, tmp_path_factory, inputs, "gpt2")
    ns = build_parser().parse_args(["export", str(one_dir), "--to", "hf", str(tmp_path / "exported"),
                                    "--max-shard-mb", "0.05"])
    assert cmd_export(ns) == 0
    assert "from_pretrained" in capsys.readouterr().out
    shards = sorted((tmp_path / "exported").glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and (tmp_path / "exported" / INDEX_FILE).is_file()
    assert json.loads((tmp_path / "exported" / "tokenizer.json").read_text()) == \
        json.loads(Path(inputs["tokenizer"]).read_text())  # the run's tokenizer (written compact by the run)
    weights, logits = exported(tmp_path)
    at_end, _ = exported(one_dir)
    assert weights.keys() == at_end.keys() and "lm_head.weight" not in weights  # tied: stored once
    assert all(torch.equal(weights[n], at_end[n]) for n in weights)
    assert (logits - one["logits"]).abs().max() < 1e-6
    assert json.loads((tmp_path / "exported" / "config.json").read_text())["use_cache"] is False  # the source's own
    for rank in (1, 0):  # two writers, each its own shards (as the ranks do at the end of training): the same files
        export_hf(one_dir, tmp_path / "by-two", max_shard_bytes=int(0.05 * 2**20), rank=rank, world=2)
    files = sorted(p.name for p in (tmp_path / "exported").iterdir())
    assert sorted(p.name for p in (tmp_path / "by-two").iterdir()) == files
    for name in files:
        assert (tmp_path / "by-two" / name).read_bytes() == (tmp_path / "exported" / name).read_bytes(), name
    with pytest.raises(ConfigError, match="the formats are hf"):
        cmd_export(build_parser().parse_args(["export", str(one_dir), "--to", "gguf", str(tmp_path / "x")]))


def test_an_exported_fine_tune_loads_with_its_tokens_and_generates_with_the_cache(rank_pool, tmp_path_factory,
                                                                                  inputs, monkeypatch):
    """The pretrained folder examples/make_pretrained.py writes offline (a Llama, its tokenizer with end and
    padding tokens and a chat template), fine-tuned on one process and exported at the end of training: the
    export loads with AutoTokenizer and AutoModelForCausalLM (offline), keeps the tokens, the template and the
    source's use_cache (on), and generate() runs with its key/value cache, as it does without it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder, _, one_dir = one_process(rank_pool, tmp_path_factory, inputs, "llama")
    source = AutoTokenizer.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(one_dir / "exported")
    assert (tokenizer.eos_token, tokenizer.pad_token, tokenizer.eos_token_id, tokenizer.pad_token_id) == \
        ("<eos>", "<pad>", 1, 0)
    assert tokenizer.chat_template == source.chat_template and "assistant" in tokenizer.chat_template
    model = AutoModelForCausalLM.from_pretrained(one_dir / "exported").eval()
    assert model.config.use_cache is True  # training ran without the cache; the source's own setting is back
    assert (model.generation_config.eos_token_id, model.generation_config.pad_token_id) == (1, 0)
    prompt = tokenizer(["def main():\n"], return_tensors="pt")
    with torch.no_grad():
        assert model(**prompt).past_key_values is not None  # the cache is on without asking
        cached = model.generate(**prompt, max_new_tokens=6, do_sample=False)
        plain = model.generate(**prompt, max_new_tokens=6, do_sample=False, use_cache=False)
    assert cached.shape[1] > prompt["input_ids"].shape[1] and torch.equal(cached, plain)


def test_a_tokenizer_trained_here_is_exported_with_its_settings(tmp_path, monkeypatch):
    """A tokenizer.json without settings of its own (a BPE trained by the run, a model built by name): the export
    writes tokenizer_config.json, special_tokens_map.json and generation_config.json from it and the config."""
    from transformers import AutoTokenizer, GenerationConfig
    from autopar.data.hf_tokenizer import HFTokenizer
    from autopar.train.hf_export_files import write_side_files
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    run, out = tmp_path / "run", tmp_path / "out"
    run.mkdir(), out.mkdir()
    (run / "tokenizer.json").write_text(HFTokenizer.train_bpe("alpha beta gamma delta\n" * 50, 300).to_json())
    write_side_files(run, out, {"max_position_embeddings": 64, "eos_token_id": None})
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert (tokenizer.eos_token, tokenizer.pad_token, tokenizer.eos_token_id, tokenizer.pad_token_id) == \
        ("<eos>", "<pad>", 1, 0)
    assert tokenizer.model_max_length == 64
    generation = GenerationConfig.from_pretrained(out)
    assert (generation.eos_token_id, generation.pad_token_id) == (1, 0)


def test_bpe_tokenizer_is_reused_on_resume(tmp_path):
    """--tokenizer bpe learns from the training text and is saved with the run; a resumed run (given the run folder
    or one of its checkpoints) reads it back instead of learning again, even when the data file changed since."""
    from autopar.config import DataConfig, JobConfig, ModelConfig, TrainConfig
    from autopar.job import TOKENIZER_FILE, build_job_tokenizer, data_files

    def job(resume=None):
        return JobConfig(model=ModelConfig(name="gpt-tiny"),
                         data=DataConfig(tokenizer="bpe", vocab_size=300, data=str(docs), data_cache=str(tmp_path)),
                         train=TrainConfig(out=str(tmp_path / "run"), resume=resume))

    def learned(resume=None):
        j = job(resume)
        return build_job_tokenizer(j, None, data_files(j)).to_json()

    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"alpha beta gamma {k} " * 8}) + "\n" for k in range(20)))
    first = learned()
    checkpoint = tmp_path / "run" / "checkpoints" / "step_00000002"
    checkpoint.mkdir(parents=True)
    (tmp_path / "run" / TOKENIZER_FILE).write_text(first)
    docs.write_text("".join(json.dumps({"text": f"delta epsilon zeta {k} " * 8}) + "\n" for k in range(20)))
    assert learned() != first  # learning again on the changed file gives another tokenizer
    assert learned(str(tmp_path / "run")) == first
    assert learned(str(checkpoint)) == first


def test_right_padding_needs_no_attention_mask():
    """Instruction samples are right-padded and given to the model without an attention_mask: attention is causal,
    so no real position attends to the padding after it, and positions count from 0 either way. The loss of a
    padded sample equals that of the unpadded record, and an attention_mask changes nothing it sees (gpt2: learned
    positions; llama: rotary). Tolerance 1e-5 relative: the shorter call runs other kernel shapes."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from autopar.data.files import instruction_tensors
    from autopar.train.loss import token_loss_sum
    prompt, response = [5, 17, 33, 8, 90, 41], [7, 7, 120, 64, 3]
    inputs, labels = instruction_tensors([prompt], [response], seq_len=24, eos_id=1, pad_id=0)
    n = len(prompt) + len(response)  # real inputs; the rest is padding
    assert (inputs[0, n:] == 0).all() and (labels[0, n:] == -100).all() and (labels[0, :n] != -100).sum() == 6
    batch = {"input_ids": inputs.long(), "labels": labels.long()}
    alone = {"input_ids": inputs[:, :n].long(), "labels": labels[:, :n].long()}
    mask = (torch.arange(24) < n).long()[None]
    for family in ("gpt2", "llama"):
        config = AutoConfig.for_model(family, vocab_size=VOCAB, use_cache=False, pad_token_id=0, **FAMILIES[family])
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).eval()
        with torch.no_grad():
            padded = token_loss_sum(model(batch["input_ids"]), batch)
            unpadded = token_loss_sum(model(alone["input_ids"]), alone)
            masked = token_loss_sum(model(batch["input_ids"], attention_mask=mask), batch)
        assert abs(padded - unpadded) < 1e-5 * unpadded, (family, padded, unpadded)
        assert abs(padded - masked) < 1e-5 * unpadded, (family, padded, masked)


def test_tp_slice_read_equals_slice_of_whole(tmp_path):
    """The loader reads a fused projection's per-segment slices straight from the file."""
    from transformers import AutoModelForCausalLM

    from autopar.models import build_model
    from autopar.models.pretrained import PretrainedWeights
    folder = save_pretrained("gpt2", tmp_path / "gpt2")
    model, _ = build_model(f"hf:{folder}", device="meta")
    weights = PretrainedWeights(folder, model)
    whole = AutoModelForCausalLM.from_pretrained(str(folder)).state_dict()
    target = torch.nn.Module()
    fused = "transformer.h.0.attn.c_attn.weight"  # Conv1D [64, 192]: q, k, v along dim 1
    target.register_parameter("w", torch.nn.Parameter(torch.empty(64, 96)))
    slices = [(64 * k + 32, 32) for k in range(3)]  # rank 1 of 2 in each of q, k, v
    weights.stored = {"w": fused}
    read = weights.load_into(target, lambda name: (1, slices))
    assert read == 64 * 96 * 4
    expected = torch.cat([whole[fused][:, s:s + n] for s, n in slices], dim=1)
    assert torch.equal(target.w.detach(), expected)  # bitwise: a copy of the same stored values


MOE_FAMILIES = {"mixtral": dict(num_local_experts=4), "olmoe": dict(num_experts=4),
                "qwen2_moe": dict(num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=16),
                "qwen3_moe": dict(num_experts=4, moe_intermediate_size=16)}


@pytest.mark.parametrize("family", sorted(MOE_FAMILIES))
def test_experts_stored_one_by_one_load_batched_and_a_rank_reads_only_its_experts(tmp_path, family):
    """save_pretrained writes an MoE model's experts one tensor each (mixtral: block_sparse_moe.experts.e.w1/w3/w2);
    the model holds them batched: every tensor loads bitwise as transformers loads it, and a read of experts 2:4
    (ep=2, rank 1) reads only their bytes."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from autopar.models import build_model
    from autopar.models.pretrained import PretrainedWeights
    config = AutoConfig.for_model(family, vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                                  num_experts_per_tok=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                  **MOE_FAMILIES[family])
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    expected = AutoModelForCausalLM.from_pretrained(str(tmp_path)).state_dict()
    model, _ = build_model(f"hf:{tmp_path}", device="meta")
    weights = PretrainedWeights(tmp_path, model)
    model = model.to_empty(device="cpu")
    weights.load_into(model)
    loaded = model.state_dict()
    for name in weights.stored:
        assert torch.equal(loaded[name], expected[name]), name
    assert {"model.layers.0.mlp.gate.weight", "model.layers.0.mlp.experts.gate_up_proj"} <= set(weights.stored)
    batched = "model.layers.0.mlp.experts.gate_up_proj"
    before = weights.bytes_read
    half = weights.source.read(batched, 0, [(2, 2)])
    assert torch.equal(half, expected[batched][2:4]) and weights.bytes_read - before == half.numel() * 4
    rows = weights._read_rows(batched, (1, [(3, 5), (20, 4)]), (1, 2))  # tp columns of ZeRO-3 rows: experts 1:3
    assert torch.equal(rows, torch.cat([expected[batched][1:3, 3:8], expected[batched][1:3, 20:24]], 1))


def test_zero3_rows_of_a_tp_slice_are_read_straight_from_the_file(tmp_path):
    """ZeRO-3 with tp: this rank's dp rows of its tensor-parallel slice, along dim 1 (rows and columns read
    together) and along dim 0 (the rows of the concatenated slices), equal that part of the whole tensor."""
    from safetensors.torch import load_file

    from autopar.models import build_model
    from autopar.models.pretrained import PretrainedWeights
    folder = save_pretrained("gpt2", tmp_path / "gpt2")
    model, _ = build_model(f"hf:{folder}", device="meta")
    weights = PretrainedWeights(folder, model)
    fused = "transformer.h.0.attn.c_attn.weight"  # [64, 192]: q, k, v along dim 1
    whole = load_file(str(folder / "model.safetensors"))[fused]
    slices = [(64 * k + 32, 32) for k in range(3)]
    tp_slice = torch.cat([whole[:, s:s + n] for s, n in slices], dim=1)
    assert torch.equal(weights._read_rows(fused, (1, slices), (22, 22)), tp_slice[22:44])  # bitwise: stored values
    row_slices = [(8, 16), (40, 16)]  # a tp slice along dim 0 in two segments; rows 10:20 straddle them
    tp_rows = torch.cat([whole[s:s + n] for s, n in row_slices])
    assert torch.equal(weights._read_rows(fused, (0, row_slices), (10, 10)), tp_rows[10:20])
    assert torch.equal(weights._read_rows(fused, None, (32, 32)), whole[32:64])


def test_example_llama_sharded_tp2_matches_one_process(rank_pool, tmp_path, tmp_path_factory, inputs):
    """examples/finetune_hf.py under tp2 on the inputs it made itself (a sharded Llama folder, a BPE, pairs), against
    the one-process fine-tune of the same inputs (the same settings as the example's)."""
    folder, one, one_dir = one_process(rank_pool, tmp_path_factory, inputs, "llama")
    argv = ["--workdir", str(tmp_path / "many"), "--tp", "2", "--model", str(folder), "--tokenizer",
            inputs["tokenizer"], "--data", inputs["pairs"]]
    many = rank_pool(2).run(run_example, "finetune_hf", argv)
    assert (Path(folder) / "model.safetensors.index.json").is_file()
    assert Path(many[0]["pretrained"]) == Path(folder)
    assert_same_fine_tune(one, many, one_dir, Path(many[0]["export"]).parent, Path(folder))
    assert (Path(many[0]["export"]) / "tokenizer.json").is_file()


# ----------------------------------------------------------------------------- bad input, refused clearly


def _job(tmp_path, **data):
    from autopar.config import DataConfig, JobConfig, ModelConfig, TrainConfig
    model = data.pop("model", f"hf:{tmp_path / 'gpt2'}")
    return JobConfig(model=ModelConfig(name=model), data=DataConfig(seq_len=32, data_cache=str(tmp_path / "c"), **data),
                     train=TrainConfig(out=str(tmp_path / "run")))


def test_bad_inputs_are_refused_with_what_and_why(tmp_path):
    from autopar.errors import AutoparError
    from autopar.job import make_trainer
    from autopar.models import build_model
    from autopar.models.pretrained import PretrainedWeights
    folder = save_pretrained("gpt2", tmp_path / "gpt2")
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((folder / "config.json").read_text())
    model, _ = build_model(f"hf:{bare}", device="meta")
    with pytest.raises(AutoparError, match="has no weights: expected model.safetensors"):
        PretrainedWeights(bare, model)
    config = json.loads((folder / "config.json").read_text())
    (bare / "config.json").write_text(json.dumps({**config, "n_positions": 64}))
    (bare / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    model, _ = build_model(f"hf:{bare}", device="meta")
    with pytest.raises(AutoparError, match=r"transformer.wpe.weight: the file holds \[128, 64\], the model expects "
                                           r"\[64, 64\]"):
        PretrainedWeights(bare, model)
    for layers, message in ((3, r"lack 12 parameter\(s\) of the model: transformer.h.2"),
                            (1, r"hold 12 tensor\(s\) the model does not have: transformer.h.1")):
        (bare / "config.json").write_text(json.dumps({**config, "n_layer": layers}))
        model, _ = build_model(f"hf:{bare}", device="meta")
        with pytest.raises(AutoparError, match=message):
            PretrainedWeights(bare, model)
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"body": "some words " * 20}) + "\n" for _ in range(8)))
    with pytest.raises(AutoparError, match=r"no field 'text'.*its fields are \['body'\]"):
        make_trainer(_job(tmp_path, data=str(docs)))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(AutoparError, match="is empty"):
        make_trainer(_job(tmp_path, data=str(empty)))
    import tokenizers
    big = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"w{i}": i for i in range(400)}, unk_token="w0"))
    big.save(str(tmp_path / "big.json"))
    with pytest.raises(AutoparError, match=f"tokenizer has 400 tokens but the model .* only {VOCAB}"):
        make_trainer(_job(tmp_path, data=str(docs), text_field="body", tokenizer=f"hf:{tmp_path / 'big.json'}"))
    with pytest.raises(AutoparError, match="'t5' is not a causal language model"):
        build_model("hf:t5")
    with pytest.raises(AutoparError, match="has no model type 'nosuch'"):
        build_model("hf:nosuch")


def test_any_causal_lm_type_builds_small_by_name():
    from autopar.models import build_model
    model, info = build_model("hf:mistral", {"num_hidden_layers": 1}, vocab_size=VOCAB)
    assert type(model).__name__ == "MistralForCausalLM" and info.vocab_size == VOCAB
    assert model.config.num_hidden_layers == 1 and model.config.hidden_size == 64


def test_models_hf_lists_the_causal_lm_types(capsys):
    """`autopar models --hf`: every causal-LM type transformers knows, as --model hf:<type>; no encoder-decoder."""
    from autopar.cli import build_parser, cmd_models
    assert cmd_models(build_parser().parse_args(["models", "--hf"])) == 0
    listed = {line.strip() for line in capsys.readouterr().out.splitlines()[1:]}
    assert {"hf:gpt2", "hf:llama", "hf:qwen2", "hf:mistral"} <= listed and "hf:t5" not in listed


def test_data_files_every_format_gives_the_same_tokens_once(tmp_path):
    """jsonl, parquet, csv and a save_to_disk folder of the same documents pack into the same windows; a second
    read comes from the fingerprint cache; an eval file is used as given; a .txt file is one document."""
    import datasets

    from autopar.data.files import DataFiles, build_file_datasets
    from autopar.data.hf_tokenizer import HFTokenizer
    docs = [f"document {k}: " + " ".join(f"w{(k * 7 + j) % 13}" for j in range(30)) for k in range(12)]
    tokenizer = HFTokenizer.train_bpe("\n".join(docs), 300)
    table = datasets.Dataset.from_dict({"text": docs})
    table.to_json(str(tmp_path / "d.jsonl"))
    table.to_parquet(str(tmp_path / "d.parquet"))
    table.to_csv(str(tmp_path / "d.csv"), index=False)
    table.save_to_disk(str(tmp_path / "disk"))
    windows = {}
    for name in ("d.jsonl", "d.parquet", "d.csv", "disk"):
        files = DataFiles(path=str(tmp_path / name), cache_dir=str(tmp_path / "cache"), eval_fraction=0.25)
        train, held_out, facts = build_file_datasets(files, tokenizer, seq_len=16)
        again = build_file_datasets(files, tokenizer, seq_len=16)[2]
        assert facts["data_kind"] == "text" and not facts["data_cached"] and again["data_cached"]
        windows[name] = torch.stack([train[i]["input_ids"] for i in range(len(train))])
        assert len(held_out) >= 1
    for name, value in windows.items():
        assert torch.equal(value, windows["d.jsonl"]), name  # the same token ids, integers
    (tmp_path / "d.txt").write_text("\n".join(docs))
    files = DataFiles(path=str(tmp_path / "d.txt"), eval_path=str(tmp_path / "d.parquet"),
                      cache_dir=str(tmp_path / "cache"))
    train, held_out, facts = build_file_datasets(files, tokenizer, seq_len=16)
    every_doc = sum(len(ids) + 1 for ids in tokenizer.encode_many(docs))  # each document and its end token
    assert len(held_out) == (every_doc - 1) // 16  # the whole eval file, nothing held out of the .txt
    one_doc = len(tokenizer.encode_many(["\n".join(docs)])[0]) + 1
    assert len(train) == (one_doc - 1) // 16
