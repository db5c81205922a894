"""The benchmark drivers behind the product's commands (`engine bench`, `quant-report`, `roofline`,
`sweep`): each builds its own engines and models and interleaves what it compares in one run."""
