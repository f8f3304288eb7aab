"""Jina-embeddings-v3 against transformers' JinaEmbeddingsV3Model, sentence-transformers 6 and the hub's task LoRA.

The tiny backbone (2 layers, hidden 32, 2 heads of 16, RoPE) is written by transformers itself (the hub's
tensor names: emb_ln, mixer.Wqkv, norm1, mlp.fc1) and saved by sentence-transformers 6 with mean pooling,
Normalize and the model's task prompts, as jinaai/jina-embeddings-v3 is. transformers' class has no LoRA
adapters, so the hub's layout is built from it: its config.json (`xlm-roberta` with rotary positions,
`lora_adaptations`, `task_instructions`) and every Linear and Embedding as a parametrization with seeded
`lora_A` / `lora_B` stacks per task. The reference for a task is sentence-transformers' own pipeline over
transformers' model with that task's adapter registered on each layer as a torch parametrization computing
what the hub's `LoRAParametrization.lora_forward` computes (`HubLoRA` below; transcribed from
jinaai/xlm-roberta-flash-implementation's modeling_lora.py), the fused Wqkv's update split into q, k and v
rows where transformers splits the projection.
"""

import json
import shutil

import hf_tiny
import numpy as np
import pytest
from conftest import TINY_TABLE, cosine_rows, warm_encoder

from jaxserve import Encoder
from jaxserve.errors import CheckpointError, InputError
from jaxserve.models import FAMILIES, bert, family_of, jina_v3

VOCAB = hf_tiny.vocab("roberta")
MAX_LEN = 64  # the tiny model's max_position_embeddings: TINY_TABLE's longest seqlen
CONFIG = {"vocab_size": len(VOCAB), "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
          "num_attention_heads": 2, "max_position_embeddings": MAX_LEN, "pad_token_id": VOCAB["<pad>"],
          "rope_parameters": {"rope_type": "default", "rope_theta": 500.0}}
TASKS = ["retrieval.query", "retrieval.passage", "separation", "classification", "text-matching"]
PROMPTS = {"retrieval.query": "Represent the query for retrieving evidence documents: ",
           "retrieval.passage": "Represent the document for retrieval: ", "separation": "", "classification": "",
           "text-matching": ""}
RANK, ALPHA = 4, 2
TEXTS = ["x", "the model", "a batch of jax documents is the query " * 2, "hello, world! 42",
         " ".join(f"w{i % 10}" for i in range(40))]  # 80 tokens: truncated at MAX_LEN
# The hub's config.json (jinaai/jina-embeddings-v3's layout: remote code XLMRobertaLoRA) at the tiny model's sizes.
HUB_CONFIG = {
    "model_type": "xlm-roberta", "architectures": ["XLMRobertaModel"], "vocab_size": len(VOCAB), "hidden_size": 32,
    "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 2, "max_position_embeddings": MAX_LEN,
    "hidden_act": "gelu", "layer_norm_eps": 1e-5, "type_vocab_size": 1, "pad_token_id": VOCAB["<pad>"],
    "position_embedding_type": "rotary", "rotary_emb_base": 500.0, "use_flash_attn": True, "emb_pooler": None,
    "load_trained_adapters": True, "lora_adaptations": TASKS, "task_instructions": PROMPTS, "lora_rank": RANK,
    "lora_alpha": ALPHA, "lora_dropout_p": 0.0, "lora_main_params_trainable": False,
    "matryoshka_dimensions": [8, 16, 32], "truncate_dim": None,
}
# The hub's LoRA layers (tensor names under `roberta.`) -> transformers' modules they are, and whether an Embedding.
LORA_LAYERS = {"embeddings.word_embeddings": (["embeddings.word_embeddings"], True),
               "embeddings.token_type_embeddings": (["embeddings.token_type_embeddings"], True),
               "pooler.dense": (["pooler.dense"], False)}
for _i in range(CONFIG["num_hidden_layers"]):
    LORA_LAYERS.update({
        f"encoder.layers.{_i}.mixer.Wqkv": ([f"layers.{_i}.self_attn.{p}_proj" for p in "qkv"], False),
        f"encoder.layers.{_i}.mixer.out_proj": ([f"layers.{_i}.self_attn.o_proj"], False),
        f"encoder.layers.{_i}.mlp.fc1": ([f"layers.{_i}.mlp.fc1"], False),
        f"encoder.layers.{_i}.mlp.fc2": ([f"layers.{_i}.mlp.fc2"], False)})


def st6_save(raw, out):
    """sentence-transformers 6's save of the transformers checkpoint `raw`: mean pooling, Normalize, task prompts."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules.normalize import Normalize
    from sentence_transformers.base.modules.transformer import Transformer
    from sentence_transformers.sentence_transformer.modules.pooling import Pooling
    from transformers import PreTrainedTokenizerFast

    # transformers maps the model to XLM-R's sentencepiece tokenizer: the tiny WordPiece tokenizer.json is loaded as is
    (raw / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                            "pad_token": "<pad>", "model_max_length": MAX_LEN}))
    transformer = Transformer(str(raw))
    transformer.processor = PreTrainedTokenizerFast(tokenizer_file=str(raw / "tokenizer.json"), pad_token="<pad>")
    st = SentenceTransformer(modules=[transformer, Pooling(32, pooling_mode="mean"), Normalize()], device="cpu",
                             prompts=PROMPTS)
    st.max_seq_length = MAX_LEN
    st.save(str(out))
    return out


def hub_layout(native, out, seed=7):
    """The hub's save of the same backbone: its config.json, `roberta.` names, each LoRA layer a parametrization
    with seeded per-task A and B (B nonzero, unlike a fresh adapter's zeros)."""
    from safetensors.numpy import load_file, save_file

    hub = shutil.copytree(native, out)
    (hub / "config.json").write_text(json.dumps(HUB_CONFIG))
    tensors = load_file(hub / "model.safetensors")
    rng = np.random.default_rng(seed)
    out_tensors = {}
    for name, value in tensors.items():
        layer = name.removesuffix(".weight")
        if layer not in LORA_LAYERS:
            out_tensors[f"roberta.{name}"] = value
            continue
        rows, cols = value.shape
        table = LORA_LAYERS[layer][1]
        a_shape, b_shape = ((rows, RANK), (RANK, cols)) if table else ((RANK, cols), (rows, RANK))
        p = f"roberta.{layer}.parametrizations.weight"
        out_tensors[f"{p}.original"] = value
        out_tensors[f"{p}.0.lora_A"] = (rng.standard_normal((len(TASKS), *a_shape)) * 0.3).astype(np.float32)
        out_tensors[f"{p}.0.lora_B"] = (rng.standard_normal((len(TASKS), *b_shape)) * 0.3).astype(np.float32)
    save_file(out_tensors, str(hub / "model.safetensors"))
    return hub


def hub_lora_reference(native, hub, task):
    """sentence-transformers' model of the backbone with the hub's LoRA for `task` on every layer (parametrized)."""
    import torch
    from safetensors.torch import load_file
    from sentence_transformers import SentenceTransformer
    from torch.nn.utils import parametrize

    class HubLoRA(torch.nn.Module):
        """LoRAParametrization.lora_forward at one task: X + matmul(*swap((B[t], A[t]))) * scaling, where swap
        reverses the pair for an Embedding; `rows` the slice of the fused Wqkv that a split projection holds."""

        def __init__(self, a, b, table, rows):
            super().__init__()
            pair = (a, b) if table else (b, a)
            self.delta = (torch.matmul(*pair) * (ALPHA / RANK))[rows]

        def forward(self, x):
            return x + self.delta

    st = SentenceTransformer(str(native), device="cpu")
    model, tensors, t = st[0].model, load_file(hub / "model.safetensors"), TASKS.index(task)
    for layer, (modules, table) in LORA_LAYERS.items():
        p = f"roberta.{layer}.parametrizations.weight.0"
        a, b = tensors[f"{p}.lora_A"][t], tensors[f"{p}.lora_B"][t]
        for k, module in enumerate(modules):
            target = model.get_submodule(module)
            n = target.weight.shape[0]
            parametrize.register_parametrization(target, "weight", HubLoRA(a, b, table, slice(k * n, (k + 1) * n)))
    return st


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(transformers/sentence-transformers dir, the hub's layout of it, Encoder of the first warmed on TINY_TABLE)."""
    import transformers

    root = tmp_path_factory.mktemp("jina_v3")
    raw = hf_tiny.write(root / "hf", "JinaEmbeddingsV3Model", transformers.JinaEmbeddingsV3Config(**CONFIG),
                        kind="roberta", seed=3, scale=0.3)
    native = st6_save(raw, root / "st")
    return native, hub_layout(native, root / "hub"), warm_encoder(native, TINY_TABLE)


def test_hidden_states_match_transformers(checkpoints):
    native, _, enc = checkpoints
    assert enc.family.name == "jina_embeddings_v3" and enc.model_config.adapters == ()
    model = hf_tiny.torch_model(native, "JinaEmbeddingsV3Model")
    docs = [np.asarray(ids, np.int32) for ids in enc.tokenizer.encode(TEXTS)]
    hf_tiny.check_hidden(enc.family, enc.model_config, enc.params, model, docs)


def test_backbone_matches_sentence_transformers(checkpoints):
    from sentence_transformers import SentenceTransformer

    native, _, enc = checkpoints
    st = SentenceTransformer(str(native), device="cpu")
    assert enc.embedding_config.max_seq_length == MAX_LEN
    assert max(len(ids) for ids in hf_tiny.full_ids(native, TEXTS)) > MAX_LEN  # truncated the same way on both sides
    assert cosine_rows(enc.embed(TEXTS), st.encode(TEXTS)).min() >= 0.99999
    got = enc.embed(TEXTS, prompt_name="retrieval.query")  # no adapters here: the prompts are plain prompts
    assert cosine_rows(got, st.encode(TEXTS, prompt_name="retrieval.query")).min() >= 0.99999


@pytest.mark.parametrize("task", ["retrieval.query", "classification", "text-matching"])
def test_task_adapters_match_the_hub_lora(checkpoints, task):
    """Loaded with a task, its adapter is in the weights and its prompt (from the checkpoint) is the default:
    `SentenceTransformer.encode(texts, prompt_name=task)` with the hub's LoRA of that task on transformers' model."""
    native, hub, backbone = checkpoints
    enc = warm_encoder(hub, TINY_TABLE, task=task)
    assert enc.family.name == "jina_embeddings_v3" and enc.model_config.task == task
    assert enc.embedding_config.default_prompt_name == task
    st = hub_lora_reference(native, hub, task)
    want = st.encode(TEXTS, prompt_name=task)
    assert cosine_rows(enc.embed(TEXTS), want).min() >= 0.99999
    assert cosine_rows(backbone.embed(TEXTS, prompt_name=task), want).max() < 0.999  # the adapter matters


def test_the_offline_job_records_the_task_and_ray_actors_load_it(checkpoints, tmp_path):
    """`jaxserve embed` records the task with its output (a rerun or resume with another is refused, not mixed),
    and `--ray` hands it to the actors: Ray Data's `Embedder` loads that adapter (it once loaded none, or
    $JAXSERVE_TASK's, whatever the driver ran)."""
    from jaxserve.integrations.ray_data import Embedder
    from jaxserve.offline.corpus import Corpus
    from jaxserve.offline.job import job_state

    _, hub, backbone = checkpoints
    enc = warm_encoder(hub, TINY_TABLE, task="retrieval.query")
    got = Embedder(model=str(hub), column="t", table=TINY_TABLE, task="retrieval.query")({"t": np.array(TEXTS)})
    assert cosine_rows(got["embedding"], enc.embed(TEXTS)).min() >= 0.99999
    (tmp_path / "c.txt").write_text("\n".join(TEXTS) + "\n")
    corpus = Corpus(str(tmp_path / "c.txt"), None, None)
    assert job_state(enc, corpus, len(TEXTS), "truncate", None, None)["task"] == "retrieval.query"
    assert "task" not in job_state(backbone, corpus, len(TEXTS), "truncate", None, None)  # as before: no adapter


def test_packed_rows_equal_padded_rows_with_a_task(checkpoints, monkeypatch):
    """Also the task named by $JAXSERVE_TASK (the padded encoder is loaded without naming one)."""
    _, hub, _ = checkpoints
    monkeypatch.setenv("JAXSERVE_TASK", "retrieval.passage")
    enc = warm_encoder(hub, TINY_TABLE)
    assert enc.model_config.task == "retrieval.passage"
    hf_tiny.assert_packed_equals_padded(enc, hub, TEXTS, MAX_LEN)


def test_bfloat16_close_to_float32(checkpoints):
    native, _, enc = checkpoints
    hf_tiny.assert_bfloat16_close(enc, native, TEXTS, TINY_TABLE)


def test_no_task_is_the_backbone(checkpoints):
    """The hub's layout loaded without a task runs its weights without adapters (the hub's `encode` without a
    task), the transformers save's encoder; a task's prompt is refused there, as it would run the wrong weights."""
    _, hub, backbone = checkpoints
    enc = warm_encoder(hub, TINY_TABLE)
    assert enc.model_config.task is None and enc.embedding_config.default_prompt_name is None
    np.testing.assert_allclose(enc.embed(TEXTS), backbone.embed(TEXTS), atol=2e-5)
    with pytest.raises(InputError, match="'retrieval.query' is the prompt of another task adapter; this server runs "
                                         "no task adapter"):
        enc.embed(TEXTS, prompt_name="retrieval.query")


async def test_served_with_one_task_refuses_another(make_server, checkpoints):
    _, hub, _ = checkpoints
    enc = warm_encoder(hub, TINY_TABLE, task="retrieval.query")
    client = await make_server(enc)
    info = await (await client.get("/info")).json()
    assert (info["family"], info["pooling"], info["max_input_length"]) == ("jina_embeddings_v3", "mean", MAX_LEN)
    resp = await client.post("/v1/embeddings", json={"input": TEXTS, "encoding_format": "float"})
    assert resp.status == 200
    got = np.array([d["embedding"] for d in (await resp.json())["data"]])
    np.testing.assert_allclose(got, enc.embed(TEXTS), atol=1e-5)
    for route, body, status in [("/v1/embeddings", {"input": TEXTS}, 400), ("/embed", {"inputs": TEXTS}, 422)]:
        resp = await client.post(route, json={**body, "prompt_name": "retrieval.passage"})  # TEI's status for bad input
        assert resp.status == status
        assert "this server runs the 'retrieval.query' adapter" in (await resp.text())
        resp = await client.post(route, json={**body, "prompt_name": "retrieval.query"})
        assert resp.status == 200


def test_prompts_from_task_instructions(checkpoints, tmp_path):
    """Without sentence-transformers' prompts, config.json's task_instructions are the prompts; the task's is the
    default, another task's is refused, and a save's default naming another task is dropped."""
    from jaxserve.checkpoint.config import EmbeddingConfig, read_model_config

    _, hub, _ = checkpoints
    bare = shutil.copytree(hub, tmp_path / "bare")
    (bare / "config_sentence_transformers.json").write_text(json.dumps({"prompts": {"other": "x: "},
                                                                        "default_prompt_name": "separation"}))
    emb = EmbeddingConfig.from_checkpoint(bare, read_model_config(bare, "retrieval.passage")[1])
    assert dict(emb.prompts) == {"other": "x: ", **PROMPTS} and emb.default_prompt_name == "retrieval.passage"
    assert emb.prompt() == PROMPTS["retrieval.passage"] and emb.prompt("other") == "x: "
    with pytest.raises(InputError, match="this server runs the 'retrieval.passage' adapter"):
        emb.prompt("separation")
    assert EmbeddingConfig.from_checkpoint(bare, read_model_config(bare)[1]).default_prompt_name is None


def test_family_by_config():
    """The hub's config says xlm-roberta: rotary positions make it Jina-embeddings-v3, absolute ones XLM-R."""
    assert family_of(HUB_CONFIG) is jina_v3.FAMILY
    assert family_of({**HUB_CONFIG, "position_embedding_type": "absolute"}) is bert.FAMILY
    hub = jina_v3.configure(HUB_CONFIG)
    native = FAMILIES["jina_embeddings_v3"].configure({"model_type": "jina_embeddings_v3", **CONFIG})
    assert (hub.adapters, hub.lora_scaling, dict(hub.task_prompts)) == (tuple(TASKS), ALPHA / RANK, PROMPTS)
    assert native.adapters == () and hub.rope_theta == native.rope_theta == 500.0
    assert jina_v3.configure({**HUB_CONFIG, "load_trained_adapters": False}).adapters == ()


def test_unknown_task_is_a_clear_error(checkpoints):
    native, hub, _ = checkpoints
    with pytest.raises(CheckpointError, match="unknown task 'retrieval'; this checkpoint's task adapters: "
                                              "'retrieval.query', 'retrieval.passage'"):
        Encoder.from_pretrained(str(hub), task="retrieval")
    with pytest.raises(CheckpointError, match="task 'classification' asked for, but .* has no task adapters"):
        Encoder.from_pretrained(str(native), task="classification")


def test_adapters_of_the_wrong_shape_are_a_clear_error(checkpoints, tmp_path):
    _, hub, _ = checkpoints
    bad = shutil.copytree(hub, tmp_path / "bad")
    (bad / "config.json").write_text(json.dumps({**HUB_CONFIG, "lora_adaptations": TASKS[:3],
                                                 "task_instructions": {t: PROMPTS[t] for t in TASKS[:3]}}))
    with pytest.raises(CheckpointError, match="LoRA A .* and B .* are not 3 adapters of one rank"):
        Encoder.from_pretrained(str(bad), task="separation")


@pytest.mark.parametrize("edit, message", [
    ({"rotary_emb_interleaved": True}, "rotary_emb_interleaved=True"),
    ({"rotary_emb_fraction": 0.5}, "rotary_emb_fraction=0.5"),
    ({"prenorm": True}, "prenorm=True"),
    ({"rotary_emb_base": 0}, "rotary_emb_base must be a positive number"),
    ({"num_attention_heads": 3}, "is not an even head dim"),
    ({"hidden_act": "mystery"}, "unsupported hidden_act 'mystery'"),
    ({"lora_adaptations": ["a", "a"]}, "lora_adaptations must be a list of distinct task names"),
    ({"lora_rank": 0}, "lora_rank must be a positive integer"),
    ({"task_instructions": {"a": 1}}, "task_instructions must map task names to prompt texts"),
])
def test_unsupported_hub_configs_are_clear_errors(edit, message):
    with pytest.raises(CheckpointError, match=message):
        jina_v3.configure({**HUB_CONFIG, **edit})


def test_unsupported_rope_type_is_a_clear_error():
    raw = {"model_type": "jina_embeddings_v3", **CONFIG, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}}
    with pytest.raises(CheckpointError, match="unsupported RoPE parameters"):
        FAMILIES["jina_embeddings_v3"].configure(raw)
