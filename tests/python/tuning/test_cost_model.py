"""fastddp.tuning.cost_model on synthetic measurements; every expected number is worked out by hand
in the comments (link: B bytes/s of bus bandwidth, L latency; allreduce 2(n-1)/n·S/B,
alltoall and allgather (n-1)/n·S/B, plus L)."""

import pytest

from fastddp.tuning import cost_model as cm
from fastddp.link import Link
from fastddp.launch.report import projected_step_ms

MB = 1e6
# pytest.approx's default (1e-6 relative) throughout: the model's float64 sums of these
# decimal figures against the hand-worked ones differ only by decimal-to-binary rounding.
# Three 100 MB buckets ready at 50, 100 and 120 ms; backward ends at 130 ms.
BUCKETS = [cm.Bucket(50.0, 100 * MB), cm.Bucket(100.0, 100 * MB), cm.Bucket(120.0, 100 * MB)]
GB_PER_S = Link(bus_gbs=1.0)


def test_fp32_allreduce_queues_on_the_link() -> None:
    # n = 4: each allreduce 1.5 * 100 MB / 1 GB/s = 150 ms.
    # b0 50 -> 200, b1 waits for the link: 200 -> 350, b2 350 -> 500. Step = max(130, 500).
    p = cm.predict(BUCKETS, 130.0, GB_PER_S, 4, cm.allreduce_fp32(), fixed_ms=20.0)
    assert [(start, end) for *_, start, end in p.timeline] == [(50, 200), (200, 350), (350, 500)]
    assert p.comm_end_ms == 500 and p.backward_end_ms == 130
    assert p.step_ms == 520 and p.exposed_ms == 370


def test_bf16_with_kernel_costs() -> None:
    # 50 MB per allreduce at n = 4: 75 ms. Compression 0.1 ms/MB = 10 ms per bucket on the
    # compute path: ready 60, 120, 150; backward ends 130 + 30 = 160.
    # b0 60 -> 135, b1 135 -> 210, b2 210 -> 285; write-back 0.05 ms/MB: 3 * 5 = 15 ms.
    cand = cm.bf16(compress_ms_per_mb=0.1, writeback_ms_per_mb=0.05)
    p = cm.predict(BUCKETS, 130.0, GB_PER_S, 4, cand)
    assert [(s, e) for *_, s, e in p.timeline] == pytest.approx([(60, 135), (135, 210),
                                                                 (210, 285)])
    assert p.backward_end_ms == pytest.approx(160)
    assert p.step_ms == pytest.approx(300) and p.exposed_ms == pytest.approx(140)


def test_bf16_fp32_accumulation_interleaves_on_the_link() -> None:
    # 25e6 elements per bucket, n = 4: W = 2 * 4 * ceil(25e6 / 4) = 50 MB; alltoall and
    # allgather each 0.75 * 50 MB / 1 GB/s + 1 ms = 38.5 ms. In issue order:
    # A0 @50: 50 -> 88.5;  G0 @88.5: 88.5 -> 127;  A1 @100: 127 -> 165.5;
    # A2 @120 (issued before G1 @165.5): 165.5 -> 204;  G1 @165.5: 204 -> 242.5;
    # G2 @204: 242.5 -> 281.
    link = Link(bus_gbs=1.0, latency_us=1000.0)
    p = cm.predict(BUCKETS, 130.0, link, 4, cm.bf16_fp32_accumulate())
    got = [(i, kind, nbytes, s, e) for i, kind, nbytes, s, e in p.timeline]
    want = [(0, "alltoall", 50e6, 50, 88.5), (0, "allgather", 50e6, 88.5, 127),
            (1, "alltoall", 50e6, 127, 165.5), (2, "alltoall", 50e6, 165.5, 204),
            (1, "allgather", 50e6, 204, 242.5), (2, "allgather", 50e6, 242.5, 281)]
    assert [g[:3] for g in got] == [w[:3] for w in want]
    assert [g[3:] for g in got] == pytest.approx([w[3:] for w in want])
    assert p.step_ms == pytest.approx(281)


def test_bf16_fp32_accumulation_pads_to_the_world() -> None:
    # 10 elements over n = 4: padded to 12, 24 bytes on the wire for each collective.
    bucket = cm.Bucket(0.0, 40.0)
    assert cm.bf16_fp32_accumulate().collectives(bucket, 4) == [("alltoall", 24.0),
                                                                ("allgather", 24.0)]


def test_powersgd_chains() -> None:
    # rank 2: a 1000 x 500 weight: (1500) * 2 * 2 = 6000 < 500000, compressed:
    # P = 4 * 1000 * 2 = 8000 B, Q = 4 * 500 * 2 = 4000 B. A 500 bias and a 4 x 4 weight
    # ((8) * 2 * 2 = 32 > 16) stay uncompressed: U = 4 * 516 = 2064 B. A 3 x 1 x 5 conv
    # weight is 3 x 5 with k = min(2, 3, 5) = 2: (8) * 2 * 2 = 32 > 15, uncompressed: U += 60.
    shapes = ((1000, 500), (500,), (4, 4), (3, 1, 5))
    bucket = cm.Bucket(10.0, shapes=shapes)
    assert cm.powersgd(2).collectives(bucket, 2) == [("allreduce", 2124.0 + 8000.0),
                                                     ("allreduce", 4000.0)]
    assert cm.powersgd(2, separate_uncompressed=True).collectives(bucket, 2) == [
        ("allreduce", 2124.0), ("allreduce", 8000.0), ("allreduce", 4000.0)]
    # k = min(rank, rows, cols): a 3 x 1000 matrix at rank 8 has k = 3, and (1003) * 3 * 2 =
    # 6018 > 3000: sent whole, 12000 B, in one allreduce (no P, no Q).
    assert cm.powersgd(8).collectives(cm.Bucket(0.0, shapes=((3, 1000),)), 2) == [
        ("allreduce", 12000.0)]
    # n = 2, 1 MB/s: U+P 10.124 ms, Q 4 ms, 1 ms of matmuls between them (per MB of the
    # bucket's 2.0021 MB fp32: 0.49948 ms/MB). 10 -> 20.124; Q issued 21.124 -> 25.124.
    slow = Link(bus_gbs=1e-3)
    fp32_mb = bucket.fp32_bytes / MB
    p = cm.predict([bucket], 15.0, slow, 2, cm.powersgd(2, between_ms_per_mb=1.0 / fp32_mb))
    assert [(s, e) for *_, s, e in p.timeline] == pytest.approx([(10, 20.124), (21.124, 25.124)])
    assert p.step_ms == pytest.approx(25.124)
    with pytest.raises(ValueError, match="shapes"):
        cm.predict(BUCKETS, 130.0, slow, 2, cm.powersgd(2))


def test_one_bucket_at_the_end_is_report_projection() -> None:
    # report.projected_step_ms with one bucket: compute + kernels + the whole allreduce.
    compute, kernel, wire, n, bus = 400.0, 30.0, 1.2e9, 8, 3.0
    bucket = [cm.Bucket(compute, wire)]
    p = cm.predict(bucket, compute, Link(bus), n, cm.allreduce_fp32(
        writeback_ms_per_mb=kernel / (wire / MB)))
    assert p.step_ms == pytest.approx(projected_step_ms(compute, kernel, wire, n, bus))
    assert p.step_ms == pytest.approx(400 + 30 + 700)


def test_predict_all_ranks_the_candidates() -> None:
    # n = 4, 1 GB/s, 100 MB buckets ready at 50, 100, 120: fp32 ends at 50 + 3 * 150, bf16
    # at 50 + 3 * 75; PowerSGD rank 2 of one 10000 x 2500 matrix per bucket sends 100 kB.
    shapes = ((10000, 2500),)
    buckets = [cm.Bucket(r, shapes=shapes) for r in (50.0, 100.0, 120.0)]
    ranked = cm.predict_all(buckets, 130.0, GB_PER_S, 4,
                            [cm.allreduce_fp32(), cm.bf16(), cm.powersgd(2)])
    assert [p.name for p in ranked] == ["powersgd_r2", "bf16", "allreduce_fp32"]
    assert ranked[1].step_ms == pytest.approx(50 + 3 * 75)
    assert ranked[2].step_ms == pytest.approx(50 + 3 * 150)
    # PowerSGD: P 4 * 10000 * 2 = 80 kB -> 0.12 ms, Q 20 kB -> 0.03 ms: b2 is done at
    # 120.15, before backward ends at 130; nothing is exposed.
    assert ranked[0].timeline[-1][3:] == pytest.approx((120.12, 120.15))
    assert ranked[0].step_ms == pytest.approx(130) and ranked[0].exposed_ms == 0


@pytest.mark.parametrize("buckets, backward, world, match", [
    ([], 10.0, 2, "no buckets"),
    ([cm.Bucket(5.0, 1.0), cm.Bucket(4.0, 1.0)], 10.0, 2, "in order"),
    ([cm.Bucket(11.0, 1.0)], 10.0, 2, "in order"),
    ([cm.Bucket(1.0, -1.0)], 10.0, 2, "negative"),
    ([cm.Bucket(1.0, 1.0)], 10.0, 0, "world"),
    ([cm.Bucket(1.0)], 10.0, 2, "nbytes or shapes"),
])
def test_bad_measurements_are_named(buckets: list, backward: float, world: int,
                                    match: str) -> None:
    with pytest.raises(ValueError, match=match):
        cm.predict(buckets, backward, GB_PER_S, world, cm.allreduce_fp32())


# --- rebucket: other bucket sizes from the measured arrival curve ------------------------

def test_rebucket_splits_and_merges_on_the_arrival_curve() -> None:
    # 100 bytes arrive by 1 ms, 100 more by 3 ms (hand-computed linear arrival).
    measured = [cm.Bucket(1.0, nbytes=100), cm.Bucket(3.0, nbytes=100)]
    split = cm.rebucket(measured, 50)
    assert [(b.ready_ms, b.nbytes) for b in split] == [(0.5, 50), (1.0, 50), (2.0, 50),
                                                       (3.0, 50)]
    assert [(b.ready_ms, b.nbytes) for b in cm.rebucket(measured, 150)] == [
        (2.0, 150), (3.0, 50)]
    assert [(b.ready_ms, b.nbytes) for b in cm.rebucket(measured, 1000)] == [(3.0, 200)]


def test_rebucket_never_ready_after_the_last_measured_bucket() -> None:
    measured = [cm.Bucket(114.249966, nbytes=3e6)]
    (bucket,) = cm.rebucket(measured, 25 * 2**20)
    assert bucket.ready_ms == 114.249966
    for b in cm.rebucket(measured, 0.7e6):
        assert b.ready_ms <= 114.249966


def test_rebucket_rejects_a_cap_of_zero() -> None:
    with pytest.raises(ValueError, match="cap_bytes"):
        cm.rebucket([cm.Bucket(1.0, nbytes=1)], 0)


def test_8bit_wire_pads_to_blocks_of_the_world() -> None:
    # 10 elements over n = 4: padded to 4 * 256 = 1024, plus 4 scales of 4 bytes: 1040.
    bucket = cm.Bucket(0.0, 40.0)
    assert cm.quant8("int8").collectives(bucket, 4) == [("alltoall", 1040.0),
                                                        ("allgather", 1040.0)]
    assert cm.quant8("fp8").collectives(bucket, 2) == [("alltoall", 520.0),
                                                       ("allgather", 520.0)]
    with pytest.raises(ValueError, match="name"):
        cm.quant8("int4")


def test_8bit_interleaves_on_the_link() -> None:
    # 25e6 elements per bucket, n = 4: padded to 24415 * 1024 = 25,000,960 elements, plus
    # 97,660 scales: W = 25,391,600 bytes; each collective 0.75 * W / 1 GB/s = t ms.
    # A0 @50: 50 -> 50+t; G0 -> 50+2t; A1 @100: 100 -> 100+t; G1 (issued 100+t, before
    # A2 @120): 100+t -> 100+2t; A2 -> 100+3t; G2 -> 100+4t.
    t = 0.75 * 25_391_600 / 1e6
    p = cm.predict(BUCKETS, 130.0, GB_PER_S, 4, cm.quant8("int8"))
    assert [(i, kind) for i, kind, *_ in p.timeline] == [
        (0, "alltoall"), (0, "allgather"), (1, "alltoall"), (1, "allgather"),
        (2, "alltoall"), (2, "allgather")]
    assert [e for *_, e in p.timeline] == pytest.approx(
        [50 + t, 50 + 2 * t, 100 + t, 100 + 2 * t, 100 + 3 * t, 100 + 4 * t])
    assert p.step_ms == pytest.approx(100 + 4 * t)
    # Half of bf16's bytes with the same two collectives: faster on this link.
    ranked = cm.predict_all(BUCKETS, 130.0, GB_PER_S, 4,
                            [cm.bf16_fp32_accumulate(), cm.quant8("int8")])
    assert [r.name for r in ranked] == ["int8", "bf16_fp32_accumulate"]


def test_hierarchical_gives_each_collective_its_link() -> None:
    # n = 4 as 2 nodes x 2, bf16 between the nodes. Per 100 MB bucket (25e6 elements, no
    # padding): alltoall of 100 MB inside the node, 1/2 * 100 MB / 100 GB/s = 0.5 ms; bf16
    # allreduce of the 50 MB shard's 25 MB between 2 nodes, 2(2-1)/2 * 25 MB / 1 GB/s = 25 ms;
    # allgather of 100 MB inside the node, 0.5 ms. The links serve concurrently:
    # b0: A 50 -> 50.5, R 50.5 -> 75.5, G 75.5 -> 76;  b1: A 100 -> 100.5, R 100.5 -> 125.5,
    # G 125.5 -> 126;  b2: A 120 -> 120.5 (while R1 is on the inter link), R waits for the
    # inter link: 125.5 -> 150.5, G 150.5 -> 151. Step = max(130, 151).
    links = {"intra": Link(bus_gbs=100.0), "inter": GB_PER_S}
    cand = cm.hierarchical(cm.bf16(), local_size=2)
    assert cand.name == "hier_bf16"
    p = cm.predict(BUCKETS, 130.0, GB_PER_S, 4, cand, links=links)
    assert [(i, kind) for i, kind, *_ in p.timeline] == [
        (0, "alltoall"), (0, "allreduce"), (0, "allgather"), (1, "alltoall"), (1, "allreduce"),
        (2, "alltoall"), (2, "allreduce"), (1, "allgather"), (2, "allgather")]  # issue order
    assert [(s, e) for *_, s, e in p.timeline] == pytest.approx([
        (50, 50.5), (50.5, 75.5), (75.5, 76), (100, 100.5), (100.5, 125.5), (120, 120.5),
        (125.5, 150.5), (125.5, 126), (150.5, 151)])
    assert p.step_ms == pytest.approx(151)
    # Bus bytes per link: intra 2 x 1/2 x 100 MB a bucket; inter 1 x 25 MB a bucket.
    assert p.link_bytes == pytest.approx({"intra": 300e6, "inter": 75e6})
    flat = cm.predict(BUCKETS, 130.0, GB_PER_S, 4, cm.bf16())
    assert flat.step_ms == pytest.approx(275) and flat.link_bytes == {"world": 225e6}


def test_hierarchical_int8_beats_flat_int8_across_a_slow_link() -> None:
    # n = 4 as 2 x 2, intra 100 GB/s, inter (and the flat ring) 0.2 GB/s. Flat int8 per
    # 100 MB bucket: alltoall and allgather of W = 25,391,600 B of codes and scales (as in
    # test_8bit_interleaves_on_the_link), each t = 3/4 x W / 0.2 GB/s = 95.2185 ms, all on
    # the one link: 50 + 6t. Hierarchical: 0.5 ms inside the node (1/2 x 100 MB / 100 GB/s),
    # then the int8 of the 12.5e6-element shard between the 2 nodes, padded to
    # 24,415 x 512 codes plus 48,830 scales: V = 12,695,800 B, each collective
    # s = 1/2 x V / 0.2 GB/s = 31.7395 ms; the inter link is the bottleneck from 50.5 on:
    # 50.5 + 6s, then the last allgather inside the node, 0.5 ms. Inter bytes: 6 x V / 2
    # against the flat ring's 6 x 3/4 x W: exactly a third.
    slow = Link(bus_gbs=0.2)
    links = {"intra": Link(bus_gbs=100.0), "inter": slow}
    flat = cm.predict(BUCKETS, 130.0, slow, 4, cm.quant8("int8"))
    hier = cm.predict(BUCKETS, 130.0, slow, 4, cm.hierarchical(cm.quant8("int8"), 2),
                      links=links)
    t, s = 0.75 * 25_391_600 / 0.2e6, 0.5 * 12_695_800 / 0.2e6
    assert flat.step_ms == pytest.approx(50 + 6 * t)
    assert hier.step_ms == pytest.approx(50.5 + 6 * s + 0.5)
    assert hier.link_bytes["inter"] == pytest.approx(flat.link_bytes["world"] / 3)


def test_hierarchical_kernels_and_padding() -> None:
    # Between the collectives: the intra-node sum of 1/2 of the bucket (0.2 ms/MB x 1/2) and
    # the inner's compression and write-back on the 1/2 shard ((0.1 + 0.05) / 2), spread over
    # the chain's 2 gaps: (0.1 + 0.075) / 2 = 0.0875 ms/MB.
    cand = cm.hierarchical(cm.bf16(compress_ms_per_mb=0.1, writeback_ms_per_mb=0.05), 2,
                           sum_ms_per_mb=0.2)
    assert cand.between_ms_per_mb == pytest.approx(0.0875)
    assert cand.compress_ms_per_mb == 0 and cand.writeback_ms_per_mb == 0
    # 10 elements on 2 x 2 ranks: padded to 12 (48 bytes); the int8 shard of 6 elements on 2
    # nodes pads to 2 x 256 codes plus 2 scales (520 bytes).
    chain = cm.hierarchical(cm.quant8("int8"), 2).collectives(cm.Bucket(0.0, 40.0), 4)
    assert chain == [("alltoall", 48.0, "intra", 2), ("alltoall", 520.0, "inter", 2),
                     ("allgather", 520.0, "inter", 2), ("allgather", 48.0, "intra", 2)]
    with pytest.raises(ValueError, match="not 2 or more nodes of 2"):
        cand.collectives(cm.Bucket(0.0, 40.0), 2)
    with pytest.raises(ValueError, match="local_size"):
        cm.hierarchical(cm.bf16(), 1)
    with pytest.raises(ValueError, match="link 'intra'"):
        cm.predict(BUCKETS, 130.0, GB_PER_S, 4, cand)
