"""Published numbers, tables and plots built from results files (no dependency on models/ or pipelines/)."""
