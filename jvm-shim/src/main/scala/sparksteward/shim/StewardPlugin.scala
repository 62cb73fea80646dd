package sparksteward.shim

import java.net.{InetAddress, InetSocketAddress, ServerSocket}
import java.security.SecureRandom
import java.util.{Map => JMap}

import scala.jdk.CollectionConverters._

import org.apache.spark.{SparkConf, SparkContext, SparkException, SparkFiles, TaskContext}
import org.apache.spark.api.plugin.{DriverPlugin, ExecutorPlugin, PluginContext, SparkPlugin}
import org.apache.spark.scheduler._

/** spark-steward's Spark plugin: starts and supervises the Python agents and forwards Spark's
 *  lifecycle events to them. All logic lives in the agents (python/sparksteward). */
class StewardPlugin extends SparkPlugin {
  override def driverPlugin(): DriverPlugin = new StewardDriverPlugin
  override def executorPlugin(): ExecutorPlugin = new StewardExecutorPlugin
}

object StewardPlugin {
  val ConfPrefix = "spark.steward."
  private val forwarded = Seq("spark.app.name", "spark.master", "spark.checkpoint.dir")

  def agentConf(conf: SparkConf): Map[String, String] =
    conf.getAll.filter { case (k, _) => k.startsWith(ConfPrefix) || forwarded.contains(k) }.toMap

  /** The Python for an agent, chosen like PySpark's (docs/protocol.md). */
  def python(conf: SparkConf, role: String): String = {
    val keys = if (role == "driver") Seq("spark.steward.agent.python", "spark.pyspark.driver.python", "spark.pyspark.python")
               else Seq("spark.steward.agent.python", "spark.pyspark.python")
    val envs = if (role == "driver") Seq("PYSPARK_DRIVER_PYTHON", "PYSPARK_PYTHON") else Seq("PYSPARK_PYTHON")
    (keys.flatMap(k => conf.getOption(k)) ++ envs.flatMap(e => sys.env.get(e)))
      .map(_.trim).find(_.nonEmpty).getOrElse("python3")
  }

  def command(conf: SparkConf, role: String): Seq[String] =
    Seq(python(conf, role), "-m", s"sparksteward.agents.$role")

  def newSecret(): String = {
    val bytes = new Array[Byte](32)
    new SecureRandom().nextBytes(bytes)
    bytes.map(b => f"${b & 0xff}%02x").mkString
  }

  def maxRestarts(conf: SparkConf): Int = conf.getInt("spark.steward.agent.max-restarts", 3)
}

class StewardDriverPlugin extends DriverPlugin {
  private var agent: AgentProcess = _
  private var conf: SparkConf = _

  override def init(sc: SparkContext, ctx: PluginContext): JMap[String, String] = {
    conf = sc.getConf
    val secret = StewardPlugin.newSecret()
    val host = conf.get("spark.driver.host", InetAddress.getLocalHost.getHostAddress)
    val bindHost = conf.getOption("spark.driver.bindAddress").getOrElse(host)
    val port = conf.getInt("spark.steward.driver.port", 0) match {
      case 0 => val s = new ServerSocket(); s.bind(new InetSocketAddress(bindHost, 0)); try s.getLocalPort finally s.close()
      case p => p
    }
    val hello = Messages.hello("driver", "driver", host, bindHost, port, None, None, secret,
      StewardPlugin.agentConf(conf))
    agent = new AgentProcess("driver", StewardPlugin.command(conf, "driver"), hello, StewardPlugin.maxRestarts(conf))
    agent.start()
    sc.addSparkListener(new StewardListener(agent, sc))
    Map("endpoint" -> s"$host:$port", "secret" -> secret).asJava
  }

  /** Called at the end of SparkContext start: fail the start if the agent refused to start. */
  override def registerMetrics(appId: String, ctx: PluginContext): Unit = {
    val timeoutMs = conf.getTimeAsMs("spark.steward.agent.start-timeout", "120s")
    agent.awaitAnswer(timeoutMs) match {
      case Ready(_, _) => ()
      case Fatal(code, message) =>
        throw new SparkException(s"spark-steward driver agent refused to start: $message [$code]")
      case Failed(message) => throw new SparkException(s"spark-steward: $message")
    }
  }

  override def shutdown(): Unit = if (agent != null) agent.stop()
}

class StewardListener(agent: AgentProcess, sc: SparkContext) extends SparkListener {
  private def now = System.currentTimeMillis()

  override def onApplicationStart(e: SparkListenerApplicationStart): Unit =
    agent.send(Messages.appStart(e.time, e.appId.getOrElse(sc.applicationId), e.appAttemptId, e.appName,
      sc.version, e.sparkUser), sticky = true)

  override def onApplicationEnd(e: SparkListenerApplicationEnd): Unit =
    agent.send(Messages.appEnd(e.time, e.exitCode, sc.getCheckpointDir))

  override def onJobStart(e: SparkListenerJobStart): Unit = {
    val props = Option(e.properties)
    def prop(k: String) = props.flatMap(p => Option(p.getProperty(k))).filter(_.nonEmpty)
    val tags = prop("spark.job.tags").map(_.split(",").map(_.trim).filter(_.nonEmpty).toSeq).getOrElse(Nil)
    agent.send(Messages.jobStart(e.time, e.jobId, prop("spark.jobGroup.id"), tags,
      prop("spark.job.description"), e.stageInfos.size, e.stageIds))
  }

  override def onJobEnd(e: SparkListenerJobEnd): Unit = {
    val ok = e.jobResult == JobSucceeded
    val reason = if (ok) None else Some(
      try {
        val exc = e.jobResult.getClass.getMethod("exception").invoke(e.jobResult).asInstanceOf[Throwable]
        Option(exc.getMessage).getOrElse(exc.toString)
      } catch { case _: Exception => e.jobResult.toString })
    agent.send(Messages.jobEnd(e.time, e.jobId, ok, reason))
  }

  override def onExecutorAdded(e: SparkListenerExecutorAdded): Unit =
    agent.send(Messages.executorAdded(e.time, e.executorId, e.executorInfo.executorHost, e.executorInfo.totalCores))

  override def onExecutorRemoved(e: SparkListenerExecutorRemoved): Unit =
    agent.send(Messages.executorRemoved(e.time, e.executorId, e.reason))
}

class StewardExecutorPlugin extends ExecutorPlugin {
  private var agent: AgentProcess = _

  override def init(ctx: PluginContext, extraConf: JMap[String, String]): Unit = {
    val extra = extraConf.asScala
    // ctx.hostname() throws on executors whose RpcEnv has no server address (standalone executors)
    val host = try InetAddress.getLocalHost.getHostName catch { case _: Exception => "localhost" }
    val hello = Messages.hello("executor", ctx.executorID(), host, "127.0.0.1", 0,
      extra.get("endpoint"), Some(new java.io.File(SparkFiles.getRootDirectory()).getAbsolutePath), extra.getOrElse("secret", ""),
      StewardPlugin.agentConf(ctx.conf()))
    agent = new AgentProcess("executor", StewardPlugin.command(ctx.conf(), "executor"), hello,
      StewardPlugin.maxRestarts(ctx.conf()))
    agent.start()
  }

  // TaskContext is unset before onTaskSucceeded/onTaskFailed run, so remember it from onTaskStart
  // (all three run on the task's thread).
  private val current = new ThreadLocal[(Long, Int, Int, Int, Int)]

  private def task(kind: String, reason: Option[String] = None): Unit = {
    if (kind == "task_start") {
      val tc = TaskContext.get()
      if (tc != null) current.set((tc.taskAttemptId(), tc.stageId(), tc.stageAttemptNumber(), tc.partitionId(),
        tc.attemptNumber()))
    }
    val t = current.get()
    if (t != null && agent != null) {
      agent.send(Messages.task(kind, System.currentTimeMillis(), t._1, t._2, t._3, t._4, t._5, reason))
      if (kind != "task_start") current.remove()
    }
  }

  override def onTaskStart(): Unit = task("task_start")
  override def onTaskSucceeded(): Unit = task("task_succeeded")
  override def onTaskFailed(failureReason: org.apache.spark.TaskFailedReason): Unit =
    task("task_failed", Some(failureReason.toErrorString))

  override def shutdown(): Unit = if (agent != null) agent.stop()
}
