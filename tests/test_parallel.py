"""Data parallelism: 2 devices train exactly like 1, and gradient accumulation like the full batch.

The multi-device checks run in a subprocess, because the number of CPU devices is fixed by
`XLA_FLAGS=--xla_force_host_platform_device_count=2` before JAX starts.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import pytest

from eqx_gpt.training.parallel import check_batch, data_mesh, initialize_distributed

ROOT = Path(__file__).resolve().parents[1]

WORKER = textwrap.dedent(
    """
    import json
    import jax
    import numpy as np
    from eqx_gpt import GPT, GPTConfig
    from eqx_gpt.training.parallel import data_mesh, replicate, shard_batch, shard_parameters
    from eqx_gpt.training.config import TrainConfig
    from eqx_gpt.training.step import init_optimizer_state, make_optimizer, make_train_step

    config = GPTConfig(vocab_size=65, context_length=16, d_model=32, n_heads=2, n_layers=2, dropout=0.1)

    def run(devices, grad_accum, fsdp=False, optimizer="adamw"):
        train_config = TrainConfig(batch_size=8, grad_accum=grad_accum, seed=0, optimizer=optimizer, lr=0.02,
                                   min_lr=0.002, adam_lr=3e-3)
        mesh = data_mesh(devices)
        optimizer = make_optimizer(train_config)
        model = GPT(config, key=jax.random.key(0))
        place = shard_parameters if fsdp else replicate
        model, opt_state = place((model, init_optimizer_state(optimizer, model)), mesh)
        step = make_train_step(optimizer, train_config, dropout=True)
        losses = []
        for i in range(3):
            batch = jax.random.randint(jax.random.key(100 + i), (8, 17), 0, 65)
            batch = shard_batch(batch, mesh)
            model, opt_state, loss = step(model, opt_state, batch, np.int32(i), np.float32(3e-3))
            losses.append(float(loss))
        return {
            "losses": losses,
            "batch_devices": len(batch.sharding.device_set),
            "param_devices": len(model.head.weight.sharding.device_set),
            "head": np.asarray(model.head.weight).tolist(),
            # Bytes of parameters and optimiser state held by the first device.
            "bytes_on_one_device": sum(
                x.addressable_shards[0].data.nbytes
                for x in jax.tree.leaves((model, opt_state)) if isinstance(x, jax.Array)
            ),
        }

    print(json.dumps({
        "n_devices": len(jax.devices()),
        "one": run(jax.devices()[:1], 1),
        "two": run(jax.devices(), 1),
        "two_accum": run(jax.devices(), 2),
        "two_fsdp": run(jax.devices(), 1, fsdp=True),
        "one_muon": run(jax.devices()[:1], 1, optimizer="muon"),
        "two_muon": run(jax.devices(), 1, optimizer="muon"),
        "two_accum_muon": run(jax.devices(), 2, optimizer="muon"),
        "two_fsdp_muon": run(jax.devices(), 1, fsdp=True, optimizer="muon"),
    }))
    """
)


TRAINER_WORKER = textwrap.dedent(
    """
    import json, sys
    import jax
    import eqx_gpt.training.run as trainer
    import eqx_gpt.training.setup as setup
    from eqx_gpt.training.parallel import data_mesh
    from eqx_gpt.training.config import TrainConfig

    model = dict(context_length=16, d_model=32, n_heads=2, n_layers=2, dropout=0.1)
    runs = {}
    for name, devices, fsdp in (("one", jax.devices()[:1], False), ("two", jax.devices(), False),
                                ("two_fsdp", jax.devices(), True)):
        config = TrainConfig(batch_size=8, max_steps=4, warmup_steps=1, eval_interval=4, eval_batches=2,
                             log_interval=1, fsdp=fsdp)
        setup.data_mesh = lambda devices=devices: data_mesh(devices)
        out = f"{sys.argv[1]}/{name}"
        trainer.train(config, preset=None, out_dir=out, sample_tokens=0, progress=False, log=lambda s: None,
                      **model)
        runs[name] = [json.loads(line) for line in open(f"{out}/metrics.jsonl")]
    print(json.dumps(runs))
    """
)


def _xla_flags(*flags: str) -> str:
    """The XLA flags of this process (CI's `--xla_cpu_max_isa=AVX2` run sets some) and `flags`."""
    return " ".join([os.environ.get("XLA_FLAGS", ""), *flags]).strip()


@pytest.fixture(scope="module")
def two_device_runs():
    env = dict(
        os.environ, XLA_FLAGS=_xla_flags("--xla_force_host_platform_device_count=2"), JAX_PLATFORMS="cpu"
    )
    out = subprocess.run(
        [sys.executable, "-c", WORKER], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _max_abs_diff(a, b):
    import numpy as np

    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))))


@pytest.mark.slow
@pytest.mark.xdist_group("two_device_runs")  # one worker runs the module fixture
def test_two_devices_give_the_losses_of_one(two_device_runs):
    r = two_device_runs
    assert r["n_devices"] == 2
    assert r["one"]["batch_devices"] == 1
    # The batch really was split and the parameters really live on both devices.
    assert r["two"]["batch_devices"] == 2 and r["two"]["param_devices"] == 2
    assert _max_abs_diff(r["one"]["losses"], r["two"]["losses"]) <= 1e-5
    assert _max_abs_diff(r["one"]["head"], r["two"]["head"]) <= 1e-5
    assert r["one"]["losses"][-1] != r["one"]["losses"][0]  # the steps did train


@pytest.mark.slow
@pytest.mark.xdist_group("two_device_runs")  # one worker runs the module fixture
def test_gradient_accumulation_on_two_devices_gives_the_full_batch_losses(two_device_runs):
    r = two_device_runs
    assert _max_abs_diff(r["two"]["losses"], r["two_accum"]["losses"]) <= 1e-5
    assert _max_abs_diff(r["two"]["head"], r["two_accum"]["head"]) <= 1e-5


@pytest.mark.slow
@pytest.mark.xdist_group("two_device_runs")  # one worker runs the module fixture
def test_fsdp_on_two_devices_gives_the_losses_of_one_and_halves_the_state(two_device_runs):
    r = two_device_runs
    assert _max_abs_diff(r["one"]["losses"], r["two_fsdp"]["losses"]) <= 1e-5
    assert _max_abs_diff(r["one"]["head"], r["two_fsdp"]["head"]) <= 1e-5
    # The state stayed split through the steps: each device holds about half of it (the small
    # arrays that 2 does not divide, such as step counts, are whole on both).
    assert r["two_fsdp"]["bytes_on_one_device"] < 0.52 * r["two"]["bytes_on_one_device"]


@pytest.mark.slow
@pytest.mark.xdist_group("two_device_runs")  # one worker runs the module fixture
def test_under_muon_two_devices_grad_accum_and_fsdp_give_the_losses_of_one(two_device_runs):
    r = two_device_runs
    assert r["one_muon"]["losses"] != r["one"]["losses"]  # Muon really ran
    for name in ("two_muon", "two_accum_muon", "two_fsdp_muon"):
        assert _max_abs_diff(r["one_muon"]["losses"], r[name]["losses"]) <= 1e-5, name
        assert _max_abs_diff(r["one_muon"]["head"], r[name]["head"]) <= 1e-5, name
    assert r["two_fsdp_muon"]["bytes_on_one_device"] < 0.6 * r["two_muon"]["bytes_on_one_device"]


def test_fsdp_splits_the_largest_axis_the_device_count_divides():
    from eqx_gpt.training.parallel import fsdp_axis

    assert fsdp_axis((6, 128, 384), 4) == 2
    assert fsdp_axis((6, 384, 128), 2) == 1
    assert fsdp_axis((8, 8), 2) == 0  # ties: the first
    assert fsdp_axis((6, 3), 4) is None  # 4 divides neither: the array stays whole
    assert fsdp_axis((), 2) is None
    assert fsdp_axis((6, 128, 384), 1) is None


def test_batches_that_devices_cannot_share_are_rejected_with_the_fix():
    mesh = data_mesh(jax.devices()[:1])
    check_batch(mesh, 8, 2)  # one device shares anything
    with pytest.raises(ValueError, match="multiple of grad_accum"):
        check_batch(mesh, 8, 3)


def test_distributed_start_only_when_the_environment_asks(monkeypatch):
    for var in ("JAX_COORDINATOR_ADDRESS", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert initialize_distributed() is False
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:1234")
    monkeypatch.delenv("JAX_NUM_PROCESSES", raising=False)
    with pytest.raises(ValueError, match="JAX_NUM_PROCESSES"):
        initialize_distributed()


@pytest.mark.slow
def test_the_trainer_on_two_devices_logs_the_losses_of_one_with_and_without_fsdp(tmp_path):
    env = dict(
        os.environ, XLA_FLAGS=_xla_flags("--xla_force_host_platform_device_count=2"), JAX_PLATFORMS="cpu"
    )
    out = subprocess.run(
        [sys.executable, "-c", TRAINER_WORKER, str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    runs = json.loads(out.stdout.strip().splitlines()[-1])
    one = runs["one"]
    for two in (runs["two"], runs["two_fsdp"]):  # data parallel, then with parameters split too
        assert [r["step"] for r in one] == [r["step"] for r in two]
        for key in ("loss", "grad_norm", "train_loss", "val_loss"):
            a = [r[key] for r in one if key in r]
            b = [r[key] for r in two if key in r]
            assert len(a) >= 2 and _max_abs_diff(a, b) <= 1e-5, key


MULTI_PROCESS_WORKER = textwrap.dedent(
    """
    import json, os, sys
    import jax
    from eqx_gpt.training.parallel import initialize_distributed
    port, pid, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    os.environ.update(
        JAX_COORDINATOR_ADDRESS=f"localhost:{port}", JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(pid)
    )
    assert initialize_distributed()  # what train.py calls first
    import eqx_gpt.training.run as trainer
    from eqx_gpt.training.config import TrainConfig

    model = dict(context_length=16, d_model=32, n_heads=2, n_layers=2)
    runs = {}
    for fsdp in (False, True):
        config = TrainConfig(batch_size=8, max_steps=4, warmup_steps=1, eval_interval=2, eval_batches=2,
                             log_interval=1, fsdp=fsdp)
        run_dir = f"{out}/fsdp{int(fsdp)}-process{pid}"
        trainer.train(config, preset=None, out_dir=run_dir, sample_tokens=0, progress=False,
                      log=lambda s: None, **model)
        runs[fsdp] = [json.loads(line) for line in open(f"{run_dir}/metrics.jsonl")]
    print(json.dumps({"devices": len(jax.devices()), "replicated": runs[False], "fsdp": runs[True]}))
    """
)


@pytest.mark.slow
def test_two_processes_train_and_checkpoint_with_and_without_fsdp(tmp_path):
    """Two hosts, simulated: two processes of one CPU device each, joined by `initialize_distributed`
    (train.py's start) from the environment variables. Checkpoints of FSDP-split arrays must gather
    them first."""
    import socket

    import numpy as np

    from eqx_gpt.checkpoint import load_model

    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    # One device per process: this process's flags, less any device count.
    flags = [f for f in _xla_flags().split() if "device_count" not in f]
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join(flags))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", MULTI_PROCESS_WORKER, str(port), str(pid), str(tmp_path)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for pid in (0, 1)
    ]
    outputs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, err[-3000:]
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    assert results[0]["devices"] == 2
    losses = lambda records: [(r["step"], r.get("loss"), r.get("val_loss")) for r in records]
    for mode in ("replicated", "fsdp"):
        assert losses(results[0][mode]) == losses(results[1][mode])  # both hosts log the same run
    val = lambda records: [r["val_loss"] for r in records if "val_loss" in r]
    assert len(val(results[0]["fsdp"])) == 3  # steps 0, 2 and 4
    assert _max_abs_diff(val(results[0]["replicated"]), val(results[0]["fsdp"])) <= 1e-5
    # Each host wrote whole checkpoints that load back to the same model.
    replicated = load_model(tmp_path / "fsdp0-process0")[0]
    split = load_model(tmp_path / "fsdp1-process1")[0]
    np.testing.assert_allclose(replicated.head.weight, split.head.weight, atol=1e-5)
