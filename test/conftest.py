pytest_plugins = ["physicsnemo_foldcp.testing.plugin"]
