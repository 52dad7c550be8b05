"""Published numbers, tables and plots built from results files. Of the rest of the repository it uses the interval
statistics alone (models/measure/intervals.py: paired bootstrap intervals and verdicts, the ones the benchmarks
compute), so that a table and a benchmark judge a comparison the same way; nothing of pipelines/
(tests/test_architecture.py checks both)."""
