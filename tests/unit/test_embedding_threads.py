"""backward() without a state takes the calling thread's last forward: a lookup on another thread
(an evaluation beside training) between a training forward and its backward used to become that
backward's state, so the training gradient went to the evaluation batch's keys (same shape: no
error at all)."""
import threading

import numpy as np

import one_embedding as oe


def _embedding(path):
    store = oe.make_cached_host_mem_store_options(0.05, str(path), 10_000)
    return oe.MultiTableEmbedding("e", 4, np.float32, np.int64, None, store)


def _train_one_step(path, ids, eval_ids=None):
    """Rows after one SGD step on ``ids``; ``eval_ids`` looked up on another thread between the
    forward and the backward."""
    emb = _embedding(path)
    opt = oe.Optimizer(oe.optim.SGD(lr=1.0), embeddings=[emb])
    out = emb(ids)
    if eval_ids is not None:
        t = threading.Thread(target=emb, args=(eval_ids,))
        t.start()
        t.join()
    emb.backward(np.ones_like(out))
    opt.step()
    keys, lines = emb.export()
    emb.close()
    return keys, lines


def test_a_lookup_on_another_thread_does_not_take_the_training_backward(tmp_path):
    ids = np.arange(1, 9).reshape(2, 4)
    eval_ids = np.arange(100, 108).reshape(2, 4)   # same shape: nothing would have complained
    want_keys, want_lines = _train_one_step(tmp_path / "alone", ids)
    keys, lines = _train_one_step(tmp_path / "beside", ids, eval_ids)
    assert want_keys.tolist() == list(range(1, 9))
    np.testing.assert_array_equal(keys, want_keys)
    np.testing.assert_array_equal(lines, want_lines)


def test_a_backward_on_a_thread_that_looked_nothing_up_names_the_missing_forward(tmp_path):
    emb = _embedding(tmp_path / "e")
    out = emb(np.arange(4))
    errors = []

    def backward_here():
        try:
            emb.backward(np.ones_like(out))
        except oe.InputError as e:
            errors.append(str(e))

    t = threading.Thread(target=backward_here)
    t.start()
    t.join()
    assert errors and "without a forward" in errors[0]
    emb.backward(np.ones_like(out))   # the main thread's forward is still its own
    emb.close()
