"""The paged attention family's block sizes are data: each measured row says what measured it, and the lookup takes
the chip's row for the head width, then the chip's default, then the unmeasured default."""

from systolic.kernels.paged_attention import tuned_block_sizes as tuned


def test_every_tuned_row_names_what_measured_it():
    for (kind, head_dim), row in tuned.TUNED.items():
        assert row.measured.strip(), (kind, head_dim)
        assert row.block_keys > 0 and row.tokens_per_block > 0 and row.fused_heads > 0
    assert tuned.DEFAULT.measured == ""  # the default is not a measurement


def test_blocks_for_picks_the_chip_and_head_width_then_falls_back():
    assert tuned.blocks_for(64, tuned.V5E) is tuned.TUNED[(tuned.V5E, 64)]
    assert tuned.blocks_for(256, tuned.V5E) is tuned.TUNED[(tuned.V5E, None)]
    assert tuned.blocks_for(64, "TPU v9 never timed") is tuned.DEFAULT
    assert tuned.blocks_for(64) is tuned.DEFAULT  # here: the CPU's device kind, the interpreter's blocks
