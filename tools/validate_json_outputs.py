#!/usr/bin/env python3
"""Validates structured outputs against their JSON schemas with Debian's
python3-jsonschema (an independent validator: troupe's grammar compiler
plays no part here).

Input (a file): {"schemas": [schema, ...], "outputs": [{"schema": i, "text": "..."}]}
Prints one line per invalid output and a summary; exits 1 if any is invalid.
"""
import json
import sys

import jsonschema


def main(path):
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    validators = [jsonschema.Draft202012Validator(s) for s in data["schemas"]]
    for v in validators:
        v.check_schema(v.schema)
    bad = 0
    for out in data["outputs"]:
        text = out["text"]
        try:
            value = json.loads(text)
        except ValueError as e:
            bad += 1
            print(f"schema {out['schema']}: not JSON ({e}): {text!r}")
            continue
        errors = list(validators[out["schema"]].iter_errors(value))
        if errors:
            bad += 1
            print(f"schema {out['schema']}: {errors[0].message}: {text!r}")
    print(f"validated {len(data['outputs'])} outputs over {len(validators)} schemas: {bad} invalid")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
