"""`python -m gemini_ext export`: checkpoints of both formats to one safetensors file equal to
engine.state_dict(), streaming with bounded memory; a HuggingFace directory from_pretrained reads."""

import json
import os

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

import gemini_ext as gx
from conftest import DEVICES, run_python
from dist_utils import run_ranks
from gemini_ext.export import export
from parity_utils import batch, config, make_models

LAYERS, WIDTH = 16, 1024  # 64 MiB of fp32 weights in tensors of 4 MiB


def _wide_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=(k % 2 == 0)) for k in range(LAYERS)])


def _file_order(path) -> list:
    """The tensors of a safetensors file in the order of their bytes (its header's offsets;
    older safetensors releases hand back the keys sorted by name)."""
    with open(path, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    header.pop("__metadata__", None)
    return sorted(header, key=lambda k: header[k]["data_offsets"][0])


def _save_at_two_ranks(rank, world_size, path):
    model = _wide_model()
    cfg = gx.GeminiConfig(device="sim", precision="bf16", chunk_config_dict={"chunk_size": WIDTH * WIDTH})
    with gx.enable(model, cfg, process_group=dist.group.WORLD) as engine:
        opt = engine.optimizer(torch.optim.SGD, lr=0.1, momentum=0.9)
        x = torch.randn(4, WIDTH, dtype=torch.bfloat16)  # bf16 compute: the input in that dtype
        model(x).square().mean().backward()
        opt.step()
        engine.save_checkpoint(os.path.join(path, "ckpt"))
        sd = engine.state_dict()
    if rank == 0:
        torch.save(sd, os.path.join(path, "expected.pt"))


def test_sharded_checkpoint_exports_equal_to_the_state_dict_with_bounded_memory(tmp_path):
    run_ranks(2, _save_at_two_ranks, str(tmp_path))
    expected = torch.load(tmp_path / "expected.pt")
    # Measured in a fresh interpreter, as the command line runs, with glibc's mmap threshold pinned
    # at 1 MiB: by default the threshold rises to the size of the largest block freed, after which
    # 4 MiB blocks come from the heap and freed ones stay there for reuse, a cache of the C
    # allocator whose size varies from run to run (20-28 MiB here), not memory export holds.
    measure = ("import json, sys; from gemini_ext.export import anon_rss_bytes, export; before = anon_rss_bytes(); "
               "summary = export(sys.argv[1], sys.argv[2], progress=False); "
               "print(json.dumps(dict(summary, before=before)))")
    out = run_python("-c", measure, str(tmp_path / "ckpt"), str(tmp_path / "model.safetensors"),
                     env={"MALLOC_MMAP_THRESHOLD_": str(1 << 20)})
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    before = summary["before"]
    got = load_file(tmp_path / "model.safetensors")
    assert _file_order(tmp_path / "model.safetensors") == list(expected), "the model's keys, in its order"
    for key, value in expected.items():
        assert torch.equal(got[key], value), key
    model_bytes = sum(v.numel() * 4 for v in expected.values())
    grown = summary["peak_anon_bytes"] - before
    assert summary["largest_tensor_bytes"] == WIDTH * WIDTH * 4
    print(f"export of {model_bytes >> 20} MiB: anonymous memory grew by {grown / 2**20:.1f} MiB")
    # one tensor assembled at a time, sampled while it is held (measured: 4.2 MiB for this 64 MiB model)
    assert summary["largest_tensor_bytes"] <= grown <= summary["largest_tensor_bytes"] + (2 << 20), (grown, model_bytes)
    bf16 = export(str(tmp_path / "ckpt"), str(tmp_path / "bf16.safetensors"), dtype="bf16", progress=False)
    assert bf16["bytes"] * 2 == summary["bytes"]
    assert torch.equal(load_file(tmp_path / "bf16.safetensors")["0.weight"], expected["0.weight"].bfloat16())


@pytest.mark.parametrize("device", DEVICES)
def test_one_process_checkpoint_and_the_command_line(tmp_path, device):
    model, _ = make_models()
    with gx.enable(model, config(device)) as engine:
        opt = engine.optimizer(torch.optim.AdamW)
        x, y = batch(model.cfg, 0, engine.compute_device)
        model(x, y).backward()
        opt.step()
        engine.save_checkpoint(str(tmp_path / "ckpt"))
        expected = {k: v.cpu() for k, v in engine.state_dict().items()}
    out = run_python("-m", "gemini_ext", "export", str(tmp_path / "ckpt"), str(tmp_path / "m.safetensors"),
                     "--no-progress")
    assert out.returncode == 0, out.stderr
    assert "peak anonymous memory" in out.stdout
    got = load_file(tmp_path / "m.safetensors")
    assert sorted(got) == sorted(expected) and all(torch.equal(got[k], expected[k]) for k in expected)
    with pytest.raises(FileNotFoundError, match="save_checkpoint"):
        export(str(tmp_path / "nowhere"), str(tmp_path / "x.safetensors"), progress=False)
    with pytest.raises(ValueError, match="dtype 'int8'"):
        export(str(tmp_path / "ckpt"), str(tmp_path / "x.safetensors"), dtype="int8", progress=False)


def test_huggingface_directory_loads_with_from_pretrained(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 128, (2, 16))
    with gx.enable(model, gx.GeminiConfig(device="sim", precision="fp32", chunk_config_dict={"chunk_size": 8192})) \
            as engine:
        opt = engine.optimizer(torch.optim.AdamW, lr=1e-2)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        engine.save_checkpoint(str(tmp_path / "ckpt"))
        expected = engine.state_dict()
    cfg.save_pretrained(tmp_path / "cfg")
    export(str(tmp_path / "ckpt"), str(tmp_path / "hf"), config=str(tmp_path / "cfg" / "config.json"), progress=False)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["hidden_size"] == 32
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf")
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, expected[key]), key
    # --config takes the directory holding config.json; a config of another model is refused in one line
    from gemini_ext.__main__ import main
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "hf2"), "--config", str(tmp_path / "cfg"),
                 "--no-progress"]) == 0
    assert (tmp_path / "hf2" / "config.json").is_file()
    cfg.num_hidden_layers, cfg.hidden_size = 3, 48
    cfg.save_pretrained(tmp_path / "other")
    with pytest.raises(ValueError, match="does not match.*missing \\(model.layers.2.*shape"):
        export(str(tmp_path / "ckpt"), str(tmp_path / "hf3"), config=str(tmp_path / "other"), progress=False)
    assert not (tmp_path / "hf3").exists(), "nothing written"
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "hf3"), "--config", str(tmp_path / "nowhere"),
                 "--no-progress"]) == 2


def test_sharded_export_with_an_index_loads_with_from_pretrained(tmp_path):
    """`gemini-ext export CKPT OUT --max-shard-size ...`: shards of at most that size in the
    model's order and model.safetensors.index.json, as save_pretrained writes them."""
    transformers = pytest.importorskip("transformers")
    from gemini_ext.__main__ import main
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    with gx.enable(model, gx.GeminiConfig(device="sim", precision="fp32", chunk_config_dict={"chunk_size": 8192})) \
            as engine:
        engine.save_checkpoint(str(tmp_path / "ckpt"))
        expected = engine.state_dict()
    cfg.save_pretrained(tmp_path / "cfg")
    limit = 20_000  # bytes: the 16 KiB embedding alone, the layers' tensors several to a shard
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--config",
                 str(tmp_path / "cfg" / "config.json"),
                 "--max-shard-size", f"{limit}B", "--no-progress"]) == 0
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors", files
    assert sorted(index["weight_map"]) == sorted(expected)
    assert index["metadata"]["total_size"] == sum(v.numel() * 4 for v in expected.values())
    for name in files:
        shard = load_file(tmp_path / "hf" / name)
        size = sum(v.numel() * 4 for v in shard.values())
        assert size <= limit or len(shard) == 1, (name, size)
    order = [k for name in files for k in _file_order(tmp_path / "hf" / name)]
    assert order == list(expected), "the model's keys in its order across the shards"
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf")
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, expected[key]), key
    with pytest.raises(ValueError, match="max_shard_size"):
        export(str(tmp_path / "ckpt"), str(tmp_path / "bad"), max_shard_size="five", progress=False)


def test_export_runs_where_the_native_module_is_not_built(tmp_path):
    """A checkout that was never built (here: the native module hidden from the import system):
    `import gemini_ext` works in Python-only mode, `gemini-ext export` writes the checkpoint, and
    the engine's names raise an ImportError that says how to build."""
    model, _ = make_models()
    with gx.enable(model, config("sim")) as engine:
        engine.save_checkpoint(str(tmp_path / "ckpt"))
        expected = engine.state_dict()
    hide = ("import importlib.abc, sys\n"
            "class Hide(importlib.abc.MetaPathFinder):\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name in ('gemini_ext._C', 'gemini_ext._native.built_for'):\n"
            "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
            "sys.meta_path.insert(0, Hide())\n"
            "import gemini_ext as gx\n"
            "assert gx._C is None\n"
            "try:\n"
            "    gx.enable\n"
            "except ImportError as e:\n"
            "    print('enable:', e)\n"
            "from gemini_ext.__main__ import main\n"
            "sys.exit(main(['export', sys.argv[1], sys.argv[2], '--no-progress']))\n")
    out = run_python("-c", hide, str(tmp_path / "ckpt"), str(tmp_path / "m.safetensors"))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "enable: gemini_ext's native module is not built" in out.stdout and "gemini-ext export" in out.stdout
    got = load_file(tmp_path / "m.safetensors")
    assert sorted(got) == sorted(expected) and all(torch.equal(got[k], expected[k]) for k in expected)
