"""gdsckpt.core.units: the one convention for byte counts (shown decimal; read as coreutils reads them)."""

import pytest

from gdsckpt.core.units import format_bytes, parse_size


@pytest.mark.parametrize("text,n", [
    ("512", 512), ("0", 0), ("4GB", 4 * 10**9), ("4 GB", 4 * 10**9), ("4kB", 4000), ("4KB", 4000),
    ("4GiB", 4 << 30), ("4G", 4 << 30), ("4Gi", 4 << 30), ("64M", 64 << 20), ("64MiB", 64 << 20),
    ("1.5GiB", 3 << 29), ("2TB", 2 * 10**12), ("1T", 1 << 40), ("1PiB", 1 << 50), ("12B", 12),
    # exact arithmetic: no float rounding on either side
    ("4.1GB", 4_100_000_000), ("1.001MB", 1_001_000), ("2.01kB", 2010), ("1.1kB", 1100), ("1.", 1),
    ("9007199254740993", 2**53 + 1), ("123456789012345678901234567890", 123456789012345678901234567890),
])
def test_parse_size(text, n):
    assert parse_size(text) == n


@pytest.mark.parametrize("text", ["5XB", "", "GB", "-1", "4 G B", "1.5", "0.1K", "4GBi", None, "1.0001kB", "."])
def test_parse_size_refuses(text):
    with pytest.raises(ValueError, match="size|whole number"):
        parse_size(text)


@pytest.mark.parametrize("n,text", [
    (0, "0 B"), (999, "999 B"), (1000, "1.00 kB"), (1500, "1.50 kB"), (26_600_000, "26.6 MB"),
    (999_600, "1.00 MB"), (123_456_789, "123 MB"), (3_600_000_000, "3.60 GB"), (4 << 30, "4.29 GB"),
    (42 * 10**12, "42.0 TB"),
])
def test_format_bytes(n, text):
    assert format_bytes(n) == text
