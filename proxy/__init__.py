"""The proxy layer: HTTP surface, forwarding, metering and recording (imports reports and pricing)."""
