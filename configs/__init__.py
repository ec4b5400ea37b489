"""Run configuration: `run_config.RunConfig` (pydantic), composed of one module per section
(`model`, `data`, `rollout`, `inference`, `trainer`, `reward`, `pipeline`, `storage`, `tracking`,
`placement`), `loading.load_config` (YAML + `a.b=value` overrides) and `reference` (the field
reference `asyncrl config show` prints). Kept import-free so stage configs can build on
`configs.base`."""
