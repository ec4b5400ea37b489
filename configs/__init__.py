"""Run configuration: `run_config.RunConfig` (pydantic) and `loading.load_config` (YAML +
`a.b=value` overrides). Kept import-free so stage configs can build on `configs.base`."""
