"""cdk8s app: the ft_launcher training Job and its Service, ConfigMaps and chaos drill (`make manifests`)."""
