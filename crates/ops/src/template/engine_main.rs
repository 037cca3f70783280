//! The engine's binary (component.openai_server), scaffolded by metainfer: `generate` and `serve`.
//!
//! `engine --help` and `engine <command> --help` list the commands and their flags (exit status
//! 0); an unknown command or flag is refused by name (exit status 2); a failure while running exits
//! with status 1. `serve` says on stderr which model it serves on which address once it listens.
//! The flag parsing is done; fill in the two `todo!()`s from the contracts
//! (`metainfer contract show component.openai_server`), through this crate's library.

/// One flag of a subcommand: name, value placeholder, what it does (with its default).
struct Flag {
    name: &'static str,
    value: &'static str,
    help: &'static str,
}

const GENERATE_FLAGS: &[Flag] = &[
    Flag { name: "--model", value: "DIR", help: "Hugging Face model directory; required" },
    Flag { name: "--prompt", value: "TEXT", help: "the prompt; required" },
    Flag { name: "--max-tokens", value: "N", help: "tokens to generate (default 64)" },
    Flag { name: "--temperature", value: "T", help: "sampling temperature; 0 is greedy (default 0)" },
    Flag { name: "--top-p", value: "P", help: "nucleus sampling mass in (0, 1] (default 1)" },
    Flag { name: "--top-k", value: "K", help: "keep the K most likely tokens; 0 keeps all (default 0)" },
    Flag { name: "--seed", value: "S", help: "seed of the sampler's random numbers (default 0)" },
];

const SERVE_FLAGS: &[Flag] = &[
    Flag { name: "--model", value: "DIR", help: "Hugging Face model directory; its name is the model id; required" },
    Flag { name: "--host", value: "ADDR", help: "address to listen on (default 127.0.0.1)" },
    Flag { name: "--port", value: "PORT", help: "port to listen on; 0 picks a free one (default 8000)" },
];

/// Subcommands: name, what it does, its flags.
const COMMANDS: &[(&str, &str, &[Flag])] = &[
    ("generate", "generate text for one prompt and stream it to stdout", GENERATE_FLAGS),
    ("serve", "serve the OpenAI-compatible API on HOST:PORT", SERVE_FLAGS),
];

/// Why the binary stops: bad usage (exit status 2) or a failure while running (exit status 1).
enum Fail {
    Usage(String),
    Run(String),
}

fn usage() -> String {
    let name = env!("CARGO_PKG_NAME");
    let mut s = format!("usage: {name} <command> [flags]\n\ncommands:\n");
    for (command, what, _) in COMMANDS {
        s += &format!("  {command:<10} {what}\n");
    }
    s += &format!("\n`{name} <command> --help` lists the command's flags.\n");
    s
}

fn command_help(command: &str, what: &str, flags: &[Flag]) -> String {
    let mut s = format!("usage: {} {command} [flags]\n\n{what}\n\nflags:\n", env!("CARGO_PKG_NAME"));
    for f in flags {
        s += &format!("  {:<24} {}\n", format!("{} {}", f.name, f.value), f.help);
    }
    s += &format!("  {:<24} print this help\n", "-h, --help");
    s
}

/// Check `args` against the command's flags: every flag known and followed by a value. Ok(false)
/// when help was asked for (and printed).
fn check_flags(command: &str, what: &str, flags: &[Flag], args: &[String]) -> Result<bool, Fail> {
    let mut i = 0;
    while i < args.len() {
        let a = args[i].as_str();
        if a == "--help" || a == "-h" {
            print!("{}", command_help(command, what, flags));
            return Ok(false);
        }
        if !flags.iter().any(|f| f.name == a) {
            let known: Vec<&str> = flags.iter().map(|f| f.name).collect();
            return Err(Fail::Usage(format!("unknown flag `{a}` for `{command}`; its flags: {}, --help", known.join(", "))));
        }
        if args.get(i + 1).is_none() {
            return Err(Fail::Usage(format!("`{a}` needs a value")));
        }
        i += 2;
    }
    Ok(true)
}

fn flag<'a>(args: &'a [String], name: &str) -> Option<&'a str> {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).map(String::as_str)
}

fn required<'a>(args: &'a [String], name: &str, command: &str) -> Result<&'a str, Fail> {
    flag(args, name).ok_or_else(|| Fail::Usage(format!("{command} needs {name} (see `{command} --help`)")))
}

fn parsed<T: std::str::FromStr>(args: &[String], name: &str, default: T) -> Result<T, Fail> {
    match flag(args, name) {
        None => Ok(default),
        Some(v) => v.parse().map_err(|_| Fail::Usage(format!("{name}: cannot parse {v:?}"))),
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("--help" | "-h" | "help") => {
            print!("{}", usage());
            Ok(())
        }
        Some(cmd) => match COMMANDS.iter().find(|(name, _, _)| *name == cmd) {
            Some((name, what, flags)) => match check_flags(name, what, flags, &args[1..]) {
                Ok(true) if *name == "generate" => generate(&args[1..]),
                Ok(true) => serve(&args[1..]),
                Ok(false) => Ok(()),
                Err(e) => Err(e),
            },
            None => Err(Fail::Usage(format!("unknown command `{cmd}`\n{}", usage()))),
        },
        None => Err(Fail::Usage(format!("no command given\n{}", usage()))),
    };
    match result {
        Ok(()) => {}
        Err(Fail::Usage(e)) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
        Err(Fail::Run(e)) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    }
}

fn generate(args: &[String]) -> Result<(), Fail> {
    let model = std::path::PathBuf::from(required(args, "--model", "generate")?);
    let prompt = required(args, "--prompt", "generate")?;
    let max_tokens: usize = parsed(args, "--max-tokens", 64)?;
    let temperature: f32 = parsed(args, "--temperature", 0.0)?;
    let top_p: f32 = parsed(args, "--top-p", 1.0)?;
    let top_k: usize = parsed(args, "--top-k", 0)?;
    let seed: u64 = parsed(args, "--seed", 0)?;
    let _ = (&model, prompt, max_tokens, temperature, top_p, top_k, seed);
    todo!("component.openai_server: load the model, generate with kernel.sample, stream the text")
}

fn serve(args: &[String]) -> Result<(), Fail> {
    let model = std::path::PathBuf::from(required(args, "--model", "serve")?);
    let host = flag(args, "--host").unwrap_or("127.0.0.1");
    let port: u16 = parsed(args, "--port", 8000)?;
    let id = std::fs::canonicalize(&model)
        .map_err(|e| Fail::Run(format!("--model {}: {e}", model.display())))?
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into());
    // Load the model here, before listening: /health answers 200 only once it is loaded.
    let listener =
        std::net::TcpListener::bind((host, port)).map_err(|e| Fail::Run(format!("cannot listen on {host}:{port}: {e}")))?;
    let bound = listener.local_addr().map_err(|e| Fail::Run(e.to_string()))?;
    eprintln!("serving model {id} from {} on http://{bound}", model.display());
    // component.openai_server: set TCP_NODELAY on every accepted connection (`stream.set_nodelay(true)`;
    // with axum, `axum::serve::ListenerExt::tap_io`), or pooled clients wait for a delayed ACK per request.
    todo!("component.openai_server: answer /health, /v1/models, /v1/completions and /v1/chat/completions")
}
