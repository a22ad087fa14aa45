"""Speed benchmarks (not tests): each prints side-by-side ratios and writes `benchmarks/results/*.md`."""
