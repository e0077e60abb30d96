"""ParameterServerStrategy setup, TF_CONFIG roles, local multi-process launcher."""
