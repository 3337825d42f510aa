// MathJax 3, served from the site (docs/hooks/mathjax.py). It typesets arithmatex's \( \) and \[ \] in the pages and
// the $ $ and $$ $$ of the notebooks' markdown cells (mkdocs-jupyter leaves them as text); textmacros makes \_ in
// \text{} and \texttt{} an underscore, so kv\_c\_normed shows as kv_c_normed (MathJax 3 processes no macro in text mode
// without it, and never loads it by itself: https://docs.mathjax.org/en/v3.2/input/tex/extensions/textmacros.html).
window.MathJax = {
  loader: { load: ["[tex]/textmacros"] },
  tex: {
    packages: { "[+]": ["textmacros"] },
    inlineMath: [["\\(", "\\)"], ["$", "$"]],
    displayMath: [["\\[", "\\]"], ["$$", "$$"]],
    processEscapes: true,
    processEnvironments: true,
  },
  // search no element that has a class, except these two and their class-less children (a notebook cell's <p>, <li>)
  options: { ignoreHtmlClass: ".+", processHtmlClass: "arithmatex|jp-RenderedMarkdown" },
};
