"""The recording stand-in for CUDA streams (course.streams): it computes real
results, and its model GPU gives each schedule the makespan worked out by hand."""
import numpy as np
import pytest

from course import streams

ONE_SECOND = 1 / 1024  # cost per byte: a 1 KiB chunk takes 1 s per stage


def unit_gpu(**kw):
    return streams.RecordingStreams(ONE_SECOND, ONE_SECOND, ONE_SECOND, **kw)


def chunks(n):
    return [np.full(256, i, dtype=np.float32) for i in range(n)]  # 1 KiB each


def run(gpu, host_chunks, n_streams, wait_each=False, pinned=True):
    lanes = [gpu.stream() for _ in range(n_streams)]
    staging, results = [], []  # staging buffers must outlive their copies
    for i, chunk in enumerate(host_chunks):
        s = lanes[i % n_streams]
        if pinned:
            staging.append(gpu.pinned_empty(chunk.shape, chunk.dtype))
            staging[-1][...] = chunk
        else:
            staging.append(chunk)
        d = gpu.launch(lambda a: 2 * a + 1, gpu.to_device(staging[-1], s), stream=s)
        out = gpu.pinned_empty(d.shape, d.dtype) if pinned else np.empty(d.shape, d.dtype)
        gpu.to_host(d, out, s)
        if wait_each:
            gpu.synchronize(s)
        results.append(out)
    gpu.synchronize()
    return results


@pytest.mark.parametrize("n_streams, wait_each, pinned, want", [
    (1, False, True, 12.0),   # one stream: its ops run in order, nothing overlaps
    (3, True, True, 12.0),    # waiting after each chunk: serial whatever the streams
    (3, False, False, 12.0),  # pageable buffers: each copy back blocks the host
    (2, False, True, 7.0),    # two chunks in flight: h2d of chunk 2 waits for d2h of chunk 0
    (3, False, True, 6.0),    # full pipeline: 4 chunks on the busiest engine + 2 stages of one chunk
    (4, False, True, 6.0),
])
def test_makespans_worked_by_hand(n_streams, wait_each, pinned, want):
    gpu = unit_gpu()
    results = run(gpu, chunks(4), n_streams, wait_each, pinned)
    for i, r in enumerate(results):
        np.testing.assert_array_equal(r, 2 * i + 1)
    report = gpu.report()
    assert report["makespan"] == pytest.approx(want)
    assert report["hazards"] == []
    assert report["pageable_copies"] == (0 if pinned else 8)


def test_pipelined_timeline_overlaps_three_engines():
    gpu = unit_gpu()
    run(gpu, chunks(3), 3)
    spans = {(s.kind, s.chunk): (s.start, s.end) for s in streams.timeline(gpu.log)}
    assert spans[("h2d", 1)] == (1.0, 2.0)       # copies chunk 1 while chunk 0 computes
    assert spans[("compute", 0)] == (1.0, 2.0)
    assert spans[("d2h", 0)] == (2.0, 3.0)
    assert spans[("compute", 1)] == (2.0, 3.0)


def test_one_copy_engine_needs_breadth_first_issue():
    # One copy engine takes copies in issue order: chunk by chunk, h2d(i+1)
    # queues behind d2h(i), which waits for compute(i) -- serial again.
    depth_first = unit_gpu(copy_engines=1)
    run(depth_first, chunks(4), 3)
    assert {s.engine for s in streams.timeline(depth_first.log)} == {"copy", "compute"}
    assert depth_first.report()["makespan"] == pytest.approx(12.0)
    # All copies in, then all launches, then all copies out: the copy engine never idles.
    gpu = unit_gpu(copy_engines=1)
    lanes = [gpu.stream() for _ in range(4)]
    staged = [gpu.pinned_empty(c.shape, c.dtype) for c in chunks(4)]
    d_in = [gpu.to_device(b, s) for b, s in zip(staged, lanes)]
    d_out = [gpu.launch(np.sqrt, d, stream=s) for d, s in zip(d_in, lanes)]
    for d, s in zip(d_out, lanes):
        gpu.to_host(d, gpu.pinned_empty(d.shape, d.dtype), s)
    gpu.synchronize()
    assert gpu.report()["makespan"] == pytest.approx(8.0)  # = ΣT_copy: compute is hidden


def test_copy_issued_before_wait():
    serial, piped = unit_gpu(), unit_gpu()
    run(serial, chunks(4), 2, wait_each=True)
    run(piped, chunks(4), 2)
    assert streams.copy_issued_before_wait(serial.log) == [False, False, False]
    assert streams.copy_issued_before_wait(piped.log) == [True, True, True]


def test_unordered_use_of_a_device_array_is_a_hazard():
    gpu = unit_gpu()
    a, b = gpu.stream(), gpu.stream()
    staged = gpu.pinned_empty(256, np.float32)
    staged[...] = 1
    d = gpu.to_device(staged, a)
    gpu.launch(lambda x: x + 1, d, stream=b)  # b does not wait for a's copy
    assert len(gpu.hazards) == 1 and "without being ordered after it" in gpu.hazards[0]


def test_an_event_orders_two_streams():
    gpu = unit_gpu()
    a, b = gpu.stream(), gpu.stream()
    staged = gpu.pinned_empty(256, np.float32)
    staged[...] = 1
    d = gpu.to_device(staged, a)
    gpu.wait_event(b, gpu.event_record(a))
    y = gpu.launch(lambda x: x + 1, d, stream=b)
    out = gpu.pinned_empty(y.shape, y.dtype)
    gpu.to_host(y, out, b)
    gpu.synchronize(b)  # covers a's copy too, through the event
    assert gpu.hazards == [] and gpu.unwaited() == []
    spans = {s.kind: s for s in streams.timeline(gpu.log)}
    assert spans["compute"].start == spans["h2d"].end == 1.0
    np.testing.assert_array_equal(out, 2.0)


def test_results_arrive_only_when_the_host_waits():
    gpu = unit_gpu()
    s = gpu.stream()
    staged = gpu.pinned_empty(4, np.float64)
    staged[...] = [1, 2, 3, 4]
    out = gpu.pinned_empty(4, np.float64)
    gpu.to_host(gpu.launch(np.negative, gpu.to_device(staged, s), stream=s), out, s)
    assert np.isnan(out).all()  # issued, not yet known to be done
    assert [op.kind for op in gpu.unwaited()] == ["h2d", "compute", "d2h"]
    assert any("never waited for" in h for h in gpu.report()["hazards"])
    gpu.synchronize(s)
    np.testing.assert_array_equal(out, [-1, -2, -3, -4])
    assert gpu.report()["hazards"] == []


def test_pageable_copy_blocks_the_host():
    gpu = unit_gpu()
    a, b = gpu.stream(), gpu.stream()
    d = gpu.to_device(np.ones(256, np.float32), a)  # pageable: the host waits 1 s here
    other = gpu.pinned_empty(256, np.float32)
    other[...] = 0
    y = gpu.launch(lambda x: x * 3, gpu.to_device(other, b), stream=b)
    gpu.synchronize()
    spans = streams.timeline(gpu.log)
    assert gpu.log[0].pinned is False and gpu.log[0].host_waits_for == (0,)
    assert spans[1].start == 1.0  # b's copy could not even be issued before then
    back = [gpu.to_host(a, np.empty(a.shape, a.dtype), b) for a in (y, d)]  # pageable: here at once
    assert back[0].sum() == 0 and back[1].sum() == 256


def test_overwriting_a_staging_buffer_too_early_is_a_hazard():
    gpu = unit_gpu()
    s = gpu.stream()
    staged = gpu.pinned_empty(256, np.float32)
    staged[...] = 1
    gpu.to_device(staged, s)
    staged[...] = 2  # the copy may still be reading it
    gpu.synchronize()
    assert len(gpu.hazards) == 1 and "overwritten" in gpu.hazards[0]


def test_views_of_pinned_buffers_are_pinned_and_copies_are_not():
    gpu = unit_gpu()
    s = gpu.stream()
    buf = gpu.pinned_empty((4, 256), np.float32)
    buf[...] = 0
    gpu.to_device(buf[1], s)
    gpu.to_device(buf[1].copy(), s)
    assert [op.pinned for op in gpu.log] == [True, False]


def test_misuse_is_refused():
    gpu = unit_gpu()
    s = gpu.stream()
    with pytest.raises(TypeError):
        gpu.to_device(np.ones(3), None)
    with pytest.raises(TypeError):
        gpu.to_device([1.0, 2.0], s)
    with pytest.raises(ValueError):
        gpu.to_host(np.ones(3), gpu.pinned_empty(4, np.float64), s)
    with pytest.raises(TypeError):
        gpu.wait_event(s, 12345)


def test_backend_on_this_tier():
    from course.arrays import array_module, get_array_module

    expected = streams.CupyStreams if array_module().__name__ == "cupy" else streams.RecordingStreams
    assert isinstance(streams.backend(), expected)
    assert get_array_module(np.ones(2)) is np


def test_host_arrays_are_not_device_arrays_but_views_of_device_arrays_are():
    gpu = unit_gpu()
    s = gpu.stream()
    staged = gpu.pinned_empty((4, 64), np.float32)
    staged[...] = 1
    d = gpu.to_device(staged, s)
    gpu.launch(np.sqrt, d[1:], stream=s)        # a view of a device array: fine
    assert gpu.hazards == []
    gpu.launch(np.sqrt, staged, stream=s)       # the host buffer itself: not on the device
    assert len(gpu.hazards) == 1 and "host array" in gpu.hazards[0]


def test_releasing_a_staging_buffer_before_its_copy_is_a_hazard():
    gpu = unit_gpu()
    s = gpu.stream()
    for _ in range(2):
        staged = gpu.pinned_empty(256, np.float32)   # the second one replaces the first...
        staged[...] = 1
        gpu.to_device(staged, s)                     # ...while the first copy may still run
    gpu.synchronize()
    assert len(gpu.hazards) == 1 and "released" in gpu.hazards[0]


def test_views_of_a_kept_buffer_are_watched_through_it():
    gpu = unit_gpu()
    s = gpu.stream()
    buf = gpu.pinned_empty((2, 256), np.float32)
    buf[...] = 0
    gpu.to_device(buf[1], s)
    buf[0] = 5                                       # not the part being copied
    gpu.synchronize()
    assert gpu.hazards == []
    gpu.to_device(buf[1], s)
    buf[1, 3] = 7                                    # the part being copied
    gpu.synchronize()
    assert len(gpu.hazards) == 1 and "overwritten" in gpu.hazards[0]


def test_device_arrays_compute_but_reach_the_host_only_by_to_host():
    gpu = unit_gpu()
    s = gpu.stream()
    staged = gpu.pinned_empty((2, 128), np.float32)
    staged[...] = 2
    d = gpu.launch(lambda x: (np.sqrt(x * 8) + x[0]).sum(axis=-1, dtype=np.float64), gpu.to_device(staged, s),
                   stream=s)
    assert isinstance(d, streams.DeviceArray) and d.shape == (2,) and d.dtype == np.float64
    for read in (np.asarray, float, bool, lambda a: a.tolist(), lambda a: a[0] + np.ones(2)):
        with pytest.raises((TypeError, AttributeError), match="host"):
            read(d)
    out = gpu.pinned_empty(d.shape, d.dtype)
    gpu.to_host(d, out, s)
    gpu.synchronize()
    np.testing.assert_array_equal(out, [768.0, 768.0])
    assert gpu.hazards == []
    with pytest.raises(TypeError):
        gpu.to_device(d, s)  # already on the device
