"""The application layer: the one frozen MergeConfig, its options and rules, mergekit YAML, run_merge and carry."""
