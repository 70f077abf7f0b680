// Math for pymdownx.arithmatex (generic mode), rendered by the bundled KaTeX (docs/vendor/katex): no CDN, so the
// site shows formulas offline. arithmatex emits inline math as \( ... \) and display math as \[ ... \].
document$.subscribe(({ body }) => {
  renderMathInElement(body, {
    delimiters: [
      { left: "\\[", right: "\\]", display: true },
      { left: "\\(", right: "\\)", display: false },
    ],
    throwOnError: false,
  });
});
