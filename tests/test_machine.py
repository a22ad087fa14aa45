"""The machine facts printed beside every timing: the CPU name says which vector extension it has."""

from hspec_jax.machine import cpu_model

ZEN3 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 avx avx2 fma\n"
ZEN4 = ZEN3.replace("avx2 fma", "avx2 fma avx512f avx512bw")


def test_the_cpu_name_carries_its_widest_vector_extension(tmp_path):
    for text, expected in [
        (ZEN3, "AMD EPYC (AVX2)"),
        (ZEN4, "AMD EPYC (AVX-512)"),
        (ZEN3.replace(" avx2", ""), "AMD EPYC"),
    ]:
        path = tmp_path / "cpuinfo"
        path.write_text(text)
        assert cpu_model(str(path)) == expected
    assert cpu_model(str(tmp_path / "missing"))  # no file: the platform's processor string, never empty
