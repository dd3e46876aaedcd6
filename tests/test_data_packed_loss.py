"""Rows packed by the data pipeline train exactly like their documents run one by one."""

import jax
import numpy as np
import pytest
from flax import nnx

from maxlite import config as C, step
from maxlite.data import indexed, make_iterator
from maxlite.models import Transformer


@pytest.mark.parametrize("kind", ["text", "indexed"])
def test_packed_loss_equals_separate_documents(tmp_path, kind):
    args = ["base.yml", "model_name=tiny", "dtype=float32", "max_target_length=48",
            "per_device_batch_size=1", f"dataset_type={kind}"]
    if kind == "text":
        words = "and the LORD spake unto Moses saying speak unto the children of Israel".split()
        lines = [" ".join(words[i % 5:i % 5 + 2 + i % 9]) for i in range(60)]
        (tmp_path / "d.jsonl").write_text("".join(f'{{"text": "{t}"}}\n' for t in lines))
        args.append(f"dataset_path={tmp_path / 'd.jsonl'}")
    else:
        rng = np.random.default_rng(0)
        with indexed.IndexedWriter(str(tmp_path / "d"), np.uint16) as w:
            for _ in range(100):
                w.add_document(np.append(rng.integers(1, 4096, rng.integers(3, 30)), 0))
        args.append(f"data_prefix={tmp_path / 'd'}")
    cfg = C.resolve(C.load(args), 4)
    it = make_iterator(cfg, "train", 0, 1)
    batch = next(it)
    it.close()
    with nnx.use_eager_sharding(False):
        model = Transformer(cfg, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    loss = jax.jit(lambda p, b: step.loss_sums(p, graphdef, b)[0])
    packed = loss(params, batch)
    # The same documents, one per row, padded (segment 0, weight 0) to the same length.
    T = cfg.max_target_length
    docs = {k: [] for k in batch}
    for r in range(batch["inputs"].shape[0]):
        seg = batch["segment_ids"][r]
        for s in np.unique(seg[seg > 0]):
            m = seg == s
            for k, v in batch.items():
                piece = np.ones(m.sum(), v.dtype) if k == "segment_ids" else v[r][m]
                docs[k].append(np.pad(piece, (0, T - len(piece))))
    separate = loss(params, {k: np.stack(v) for k, v in docs.items()})
    assert len(docs["inputs"]) > batch["inputs"].shape[0]  # rows really hold several documents
    np.testing.assert_allclose(float(packed), float(separate), rtol=1e-4)
